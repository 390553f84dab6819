"""The edges import and run without torch: config, knobs, params, errors, wire types, the remote clients.

Each check runs in a fresh interpreter whose ``sys.meta_path`` records every attempt to
import torch together with the project frame that made it; torch itself stays importable,
so a check fails with the line to fix rather than an ImportError somewhere downstream.
"""

from __future__ import annotations

from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from tests.integrations.fake_engine import FakeEngine
from tests.support.fresh_interpreter import run_fresh

KEY = "sk-edges"

_RECORD_TORCH = """
import importlib.abc
import json
import os
import sys
import traceback

ROOT = os.getcwd()  # the repository root
attempts = []


class RecordTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch" and not attempts:
            project = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack() if f.filename.startswith(ROOT)]
            attempts.append(project[-3:])
        return None


sys.meta_path.insert(0, RecordTorch())
"""

# NOTE: every public name of the torch-free layer; an entry that loads torch fails the test.
_EDGE_IMPORTS = """
import engine
from engine import EngineConfig, EngineError, RequestOutput, SamplingParams
from engine.config import EngineConfig
from engine.errors import ParameterError
from engine.knobs import knob, knobs_of
from engine.request_options import RequestOptions, TenantOptions
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutput
from engine.supervisor import EngineHealth, RestartPolicy
import sdk
from sdk import AsyncClient, ChatMessage, ChatRequest, ChatResult, Client, CompletionRequest, Delta, PagedError, Usage
from sdk.errors import InvalidRequestError
from sdk.http_transport import HttpTransport
from sdk.hooks import AuditLog, Hook, RegexFilter
from sdk.response_format import ResponseFormat
from sdk.tools import ToolSpec
from sdk.types import TokenLogprob
from sdk.wire import Route, to_wire
from integrations.openai_server import protocol
from integrations.openai_server.app import create_app
import integrations.cli

SamplingParams(max_tokens=4, temperature=0.5, structured_output=StructuredOutput(regex="a+"))
EngineConfig(block_size=16)
ChatRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=2)

import io
from PIL import Image
from sdk.images import ImageLimits, load_image
from sdk.types import ImagePart, TextPart

_png = io.BytesIO()
Image.new("RGB", (4, 4)).save(_png, format="PNG")
ChatMessage(role="user", content=[TextPart(text="hi"), ImagePart.of(_png.getvalue())])
load_image(_png.getvalue(), ImageLimits(), "image")  # checked, decoded and hashed without torch
"""


def _run(body: str, *args: str) -> dict:
    """Run ``body`` after the recorder in a fresh interpreter at the repository root; its last stdout line is JSON."""
    return run_fresh(_RECORD_TORCH + body, *args)


def test_edges_import_without_torch() -> None:
    """Config, knobs, params, errors, structured-output specs, SDK and server wire types load no torch, nor the engine's core."""
    result = _run(
        _EDGE_IMPORTS
        + """
CORE = ("engine.llm_engine", "engine.async_engine", "engine.core", "engine.worker", "engine.models", "engine.layers")
core = sorted(m for m in sys.modules if m.startswith(CORE))
print(json.dumps({"attempts": attempts, "torch": "torch" in sys.modules, "core": core}))
"""
    )
    assert result["attempts"] == [] and result["torch"] is False
    assert result["core"] == []  # the engine's core (the step loop, scheduler, model code) stays out too


def test_engine_classes_load_on_first_use() -> None:
    """``engine.Engine`` and ``engine.AsyncEngine`` are the real classes, loaded on first use; unknown names still fail."""
    result = _run(
        """
import engine

loaded_early = [m for m in ("engine.llm_engine", "engine.async_engine") if m in sys.modules]
from engine import AsyncEngine, Engine
from engine.async_engine import AsyncEngine as Async
from engine.llm_engine import Engine as Sync

try:
    engine.NoSuchName
    missing = None
except AttributeError as exc:
    missing = str(exc)
print(json.dumps({"early": loaded_early, "same": AsyncEngine is Async and Engine is Sync, "missing": missing}))
"""
    )
    assert result == {"early": [], "same": True, "missing": "module 'engine' has no attribute 'NoSuchName'"}


def test_remote_clients_run_without_torch(live_server, tokenizer) -> None:
    """AsyncClient, Client and both adapters over ``base_url`` chat and stream against a live server; torch never loads."""
    engine = FakeEngine(tokenizer)
    server = live_server(create_app(api_key=KEY, serving_factory=lambda: Serving(engine)))
    result = _run(
        """
import asyncio

from sdk import AsyncClient, Client
from sdk.integrations.langchain import PagedChat
from sdk.integrations.llamaindex import PagedLLM

url, key = sys.argv[1], sys.argv[2]


async def remote_async():
    async with AsyncClient(base_url=url, api_key=key) as client:
        chat = await client.chat("hi", max_tokens=3)
        streamed = "".join([d.text async for d in client.stream("hi", max_tokens=2)])
        return [chat.text, streamed]


texts = asyncio.run(remote_async())
with Client(base_url=url, api_key=key) as client:
    texts.append(client.complete("hello", max_tokens=1).text)
for adapter, run in ((PagedChat, lambda chat: chat.invoke([("human", "hi")]).content),
                     (PagedLLM, lambda llm: llm.complete("hi").text)):
    model = adapter(base_url=url, api_key=key, max_tokens=2)
    try:
        texts.append(run(model))
    finally:
        model.client.close()
print(json.dumps({"attempts": attempts, "torch": "torch" in sys.modules, "texts": texts}))
""",
        server.base_url,
        KEY,
    )
    assert result["attempts"] == [] and result["torch"] is False
    assert result["texts"] == [" ok ok ok", " ok ok", " ok", " ok ok", " ok ok"]
