"""The engine as a service."""
