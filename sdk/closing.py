"""Context-manager mixins over ``close()`` / ``aclose()``: ``with`` and ``async with`` for the SDK's closable objects."""

from __future__ import annotations

from typing import Self


class Closing:
    """``with obj:`` calls ``obj.close()`` on the way out; the class defines ``close``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClosing:
    """``async with obj:`` awaits ``obj.aclose()`` on the way out; the class defines ``aclose``."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
