"""Errors a ``paged`` command reports as its message alone (``FlagError`` is in ``engine_flags``)."""

from __future__ import annotations


class CommandError(RuntimeError):
    """A command failed for a reason its message fully states; ``paged`` prints it and exits with status 1."""
