"""Errors that leave the engine. Running out of blocks inside core/ is a ``None`` return, not an error.

Each pickles with its type and attributes (``_KeepsFields``), so that one raised in a Ray actor or another process
reaches the caller as itself, not as a plain error without its fields.
"""

from __future__ import annotations

from typing import Any


def _restore(cls: type[BaseException], args: tuple[Any, ...], fields: dict[str, Any]) -> BaseException:
    error = cls.__new__(cls)
    BaseException.__init__(error, *args)
    error.__dict__.update(fields)
    return error


class _KeepsFields:
    """Pickles an error as its class, its message and its attributes, whatever its ``__init__`` takes (the default
    calls ``cls(*args)``, which fails for an ``__init__`` whose arguments are not the message)."""

    def __reduce__(self) -> tuple[Any, ...]:
        assert isinstance(self, BaseException)
        return _restore, (type(self), self.args, self.__dict__)


class EngineError(_KeepsFields, RuntimeError):
    """The engine failed to serve a request (a fault in a step, or the engine is dead)."""


class EngineRestarting(EngineError):
    """The engine's driver died and a fresh engine is starting: the request did not run to its end; retry it.

    Raised to the requests in flight when the driver died and to those that arrive before the
    fresh engine serves (``AsyncEngine``'s self-healing, ``engine.supervisor``).

    Attributes:
        retry_after: seconds until the fresh engine is expected to serve (at least 0.1).
    """

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestPoisoned(EngineError):
    """A request was in flight at each of several driver deaths, the last time running alone among the
    suspects: it is not resumed again (``engine.resume``); the others are.

    Attributes:
        request_id: the request's id.
        num_deaths: driver deaths it was in flight at.
    """

    def __init__(self, request_id: str, num_deaths: int) -> None:
        super().__init__(
            f"request {request_id!r} was in flight at {num_deaths} driver deaths, the last while the only suspect "
            "running: it is not resumed again"
        )
        self.request_id = request_id
        self.num_deaths = num_deaths


class WorkerGroupFailed(EngineError):
    """A tensor-parallel rank died or failed a step: the step's requests fail, and the group serves no more.

    ``Engine.step`` raises it after failing the step's requests and returning their blocks; under
    ``AsyncEngine`` the supervisor then starts a fresh engine with fresh rank processes.
    """


class KVTransferFailed(EngineError):
    """A rank of a tensor- or pipeline-parallel group did not move persisted KV blocks in or out (``kv_cache_dir``):
    the blocks being loaded are not restored on any rank, a save writes nothing. The message names the rank."""


class ModelLoadError(ValueError):
    """A model path, file or architecture the loader cannot use; the message names the path and what was expected."""


class ParameterError(_KeepsFields, ValueError):
    """A setting or request field of the wrong type or outside its bounds; raised before anything is queued.

    Attributes:
        param: the offending field, as the engine names it (``temperature``, ``prompt``, ...).
        reason: the message after the field's name (``message == param + reason``), when it
            begins with it: a caller that names the field otherwise (the SDK, a wire format)
            says the same of its own name. None when the message is not built that way.
    """

    def __init__(self, param: str, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.reason = reason

    @classmethod
    def about(cls, param: str, reason: str) -> ParameterError:
        """The error ``f"{param} {reason}"``, its parts kept."""
        return cls(param, f"{param} {reason}", reason=f" {reason}")


class RequestRejected(ParameterError):
    """A prompt that can never be served as asked (empty, too long, cannot fit the KV cache); raised before it queues."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(param, message)


class EngineOverloaded(RuntimeError):
    """Admission limits (queued requests or queued prompt tokens) are full; retry later."""


class UnsupportedTask(ParameterError):
    """A model asked for what it does not do: a chat model to embed or score, an embedding model to generate.

    Attributes:
        model: the model's name; task: what was asked ("generate", "embed", "score");
        model_task: what the model does ("generate", "embed", "classify").
    """

    def __init__(self, model: str, task: str, model_task: str) -> None:
        kinds = {"generate": "a generative model", "embed": "an embedding model", "classify": "a cross-encoder"}
        served = {"generate": "generate", "embed": "embed and score", "classify": "score"}[model_task]
        super().__init__("model", f"model {model!r} is {kinds[model_task]}: it cannot {task}, only {served}")
        self.model = model
        self.task = task
        self.model_task = model_task
