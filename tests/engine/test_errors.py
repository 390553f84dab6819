"""The engine's errors cross process boundaries (Ray actors, spawned ranks) as themselves: type, message and
fields survive pickling, whatever each one's ``__init__`` takes."""

from __future__ import annotations

import pickle

import pytest

from engine.errors import (
    EngineRestarting,
    KVTransferFailed,
    ParameterError,
    RequestPoisoned,
    RequestRejected,
    UnsupportedTask,
    WorkerGroupFailed,
)

ERRORS = [
    EngineRestarting("the driver died", retry_after=2.5),
    RequestPoisoned("req-7", 2),
    WorkerGroupFailed("a pipeline-parallel rank is gone"),
    KVTransferFailed("rank 1: no such block"),
    ParameterError("distributed_executor_backend", "a placement group of 2 bundles, fewer than 4 ranks"),
    ParameterError.about("temperature", "must be at least 0, not -1"),
    RequestRejected("prompt of 9000 tokens exceeds max_model_len 8192"),
    UnsupportedTask("minilm", "generate", "embed"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_pickles_with_its_type_message_and_fields(error: Exception) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)
