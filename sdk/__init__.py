"""paged SDK."""
