"""``paged bench``: the engine against the alternatives a user would pick, measured in one run."""
