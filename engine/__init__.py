"""paged inference engine."""
