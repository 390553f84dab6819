"""Errors that leave the engine. Running out of blocks inside core/ is a ``None`` return, not an error."""


class EngineError(RuntimeError):
    """The engine failed to serve a request (a fault in a step, or the engine is dead)."""


class ModelLoadError(ValueError):
    """A model path, file or architecture the loader cannot use; the message names the path and what was expected."""


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long, cannot fit the KV cache); raised before it queues."""


class EngineOverloaded(RuntimeError):
    """Admission limits (queued requests or queued prompt tokens) are full; retry later."""
