"""Every sampling knob is accepted with the engine's bounds by every surface: SDK, wire, HTTP transport, adapters.

The cases are generated from ``knobs_of(SamplingParams)``, so a field added to the engine is
checked here without editing this file; a surface that drops it or bounds it differently fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from engine.errors import ParameterError
from engine.knobs import Knob, knobs_of
from engine.sampling_params import SamplingParams
from integrations.openai_server import protocol
from sdk.errors import InvalidRequestError
from sdk.fields import invalid_request
from sdk.types import ChatRequest, CompletionRequest
from sdk.wire import WIRE_NAMES, from_wire, to_wire
from tests.support.knob_cases import knob_cases as _cases

KNOBS = knobs_of(SamplingParams)
# NOTE: the framework adapters return one generation per call, so they take no ``n``.
NOT_IN_ADAPTERS = {"n"}
# Other fields a value needs to be valid: min_tokens is also bounded by max_tokens (the engine checks that).
CONTEXT: dict[str, dict[str, Any]] = {"min_tokens": {"max_tokens": None}}


CASES = [pytest.param(k, value, ok, id=f"{k.name}={str(value)[:12]}-{'ok' if ok else 'bad'}") for k in KNOBS for value, ok in _cases(k)]


def _check(make: Callable[[], Any], ok: bool, errors: tuple[type[Exception], ...]) -> None:
    if ok:
        make()
    else:
        with pytest.raises(errors):
            make()


@pytest.mark.parametrize(("knob", "value", "ok"), CASES)
def test_engine_sdk_and_wire_share_each_bound(knob: Knob, value: Any, ok: bool) -> None:
    """SamplingParams, the SDK request types and both wire request models accept and refuse the same values."""
    name = knob.name
    kwargs = {**CONTEXT.get(name, {}), name: value}
    _check(lambda: SamplingParams(**kwargs), ok, (ParameterError,))
    _check(lambda: ChatRequest(messages=[{"role": "user", "content": "hi"}], **kwargs), ok, (ValidationError,))
    _check(lambda: CompletionRequest(prompt="hi", **kwargs), ok, (ValidationError,))
    for route, model, extra in (
        ("chat", protocol.ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
        ("completion", protocol.CompletionRequest, {"prompt": "hi"}),
    ):
        body = {WIRE_NAMES[route].get(key, key): v for key, v in kwargs.items()}  # type: ignore[index]
        _check(lambda: model.model_validate({**extra, **body}), ok, (ValidationError,))


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.name)
def test_errors_name_the_field(knob: Knob) -> None:
    """A refused value's error names the field, as ``param``, in the engine and in the SDK."""
    bad = next(value for value, ok in _cases(knob) if not ok)
    with pytest.raises(ParameterError) as engine_error:
        SamplingParams(**{knob.name: bad})
    assert engine_error.value.param == knob.name
    with pytest.raises(ValidationError) as sdk_error:
        ChatRequest(messages=[{"role": "user", "content": "hi"}], **{knob.name: bad})
    assert invalid_request(sdk_error.value).param.split(".")[0] == knob.name


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_http_transport_body_round_trips_every_knob(route: str) -> None:
    """The HTTP transport's body carries every knob, and the server reads each one back unchanged."""
    sampling = {k.name: next(value for value, ok in _cases(k) if ok) for k in KNOBS}
    sampling["min_tokens"] = sampling["max_tokens"]
    body = to_wire(route, sampling)  # type: ignore[arg-type]
    model = protocol.ChatCompletionRequest if route == "chat" else protocol.CompletionRequest
    extra = {"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"}
    parsed = model.model_validate({**body, **extra})
    assert from_wire(route, parsed.model_dump()) == sampling  # type: ignore[arg-type]


@pytest.mark.parametrize(("knob", "value", "ok"), [c for c in CASES if c.values[0].name not in NOT_IN_ADAPTERS])
def test_adapters_share_each_bound(knob: Knob, value: Any, ok: bool) -> None:
    """PagedChat, PagedLLM (LangChain) and PagedLLM (LlamaIndex) take each knob with the engine's bounds."""
    from sdk.integrations.langchain import PagedChat, PagedLLM
    from sdk.integrations.llamaindex import PagedLLM as LlamaIndexLLM

    kwargs = {**CONTEXT.get(knob.name, {}), knob.name: value}
    for adapter in (PagedChat, PagedLLM, LlamaIndexLLM):
        _check(lambda: adapter(**kwargs), ok, (ValidationError,))


def test_adapters_take_every_knob_per_call() -> None:
    """LangChain's per-call keyword arguments cover every knob but the documented exclusions."""
    from sdk.integrations import langchain

    assert langchain._PER_CALL >= {k.name for k in KNOBS} - NOT_IN_ADAPTERS
    assert not langchain._PER_CALL & NOT_IN_ADAPTERS


def test_invalid_request_keeps_the_field_of_nested_errors() -> None:
    """The SDK's conversion of a pydantic error keeps the path to the field and echoes no input."""
    with pytest.raises(ValidationError) as err:
        ChatRequest(messages=[{"role": "user", "content": "hi"}], stop=["ok", "secret" * 400])
    error = invalid_request(err.value)
    assert isinstance(error, InvalidRequestError) and error.param == "stop.1" and "secret" not in str(error)
