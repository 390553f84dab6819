"""The fleet on a real local Ray cluster: 2 engine replicas of the tiny llama behind Ray Serve's HTTP proxy.

One cluster and one deployment for the module (starting them is most of its time). Skipped
without the ``ray`` extra.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from integrations.openai_server.app import create_app  # noqa: E402
from integrations.ray.workload import measure  # noqa: E402
from tests.support.fleet_gate import GATE_HEADER, HOLD_AFTER  # noqa: E402
from tests.support.serve_process import free_port  # noqa: E402

KEY = "sk-fleet"
ENGINE = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 16, "max_model_len": 512}
APP = "paged"
ROOT = Path(__file__).resolve().parents[2]
PROMPT = (  # a completion prompt of two full blocks
    "The old lighthouse keeper on the northern cliffs had kept the light burning for forty years, through storms "
    "and calm nights alike, and he had a long story to tell:"
)
# NOTE: a fault test waits as long as the fleet took to start, twice (at least MIN_PATIENCE): a replica's
# replacement loads a model as a starting fleet does, and on a starved machine both take minutes.
MIN_PATIENCE = 120.0  # seconds
DRAIN_TIMEOUT = 10.0  # seconds: Serve stops a replica 5 s after it, streams or not
PROXY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
STATUS_POLL = 0.2  # seconds between looks at Serve's status
STARTED: dict[str, float] = {}  # "seconds": how long the fixture's fleet took to start


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def audit_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fleet-audit") / "audit.jsonl"


@pytest.fixture(scope="module")
def fleet(model_dir, audit_path):
    """The root URL of a 2-replica fleet, prefix-affinity routing, key-protected, audited, with the test's stream gate."""
    from integrations.ray.config import app_builder

    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    # NOTE: Serve's controller kills a proxy that is not ready in 3 checks of 5 s, and serve.start then fails on the
    # proxy it waited for: on a starved machine a proxy takes longer to import. Its processes inherit this env.
    with pytest.MonkeyPatch.context() as env:
        for name, seconds in PROXY_PATIENCE.items():
            env.setenv(name, seconds)
        # NOTE: a cluster of its own ("local"), not one another process on the machine runs
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        flags = {
            "model": model_dir, "replicas": 2, "replica_cpus": 0.5, "api_key": [KEY], "audit_log": str(audit_path),
            "hook": ["tests.support.fleet_gate:make_hooks"], "drain_timeout": DRAIN_TIMEOUT, **ENGINE,
        }  # fmt: skip
        began = time.monotonic()
        # NOTE: external_scaler_enabled: a test scales the engine deployment as an operator's scaler does
        serve.run(app_builder(flags), name=APP, route_prefix="/", external_scaler_enabled=True)
        STARTED["seconds"] = time.monotonic() - began
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_names() -> list[str]:
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{APP}#engine#")
    )  # fmt: skip


def test_openai_client_chat_stream_and_errors(fleet):
    """The official client: models, chat, streaming, completions; a bad key and a bad field get the server's errors."""
    import openai

    client = openai.OpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4
    completion = client.completions.create(model=model, prompt="Once upon", max_tokens=3)
    assert completion.usage.completion_tokens == 3

    with pytest.raises(openai.AuthenticationError) as denied:
        openai.OpenAI(base_url=f"{fleet}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert denied.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=messages, max_tokens=-1)
    assert refused.value.body["param"] == "max_tokens"


def test_metrics_merge_every_replica(fleet):
    """GET /metrics answers for the whole fleet: each family once, every sample labelled with its replica."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(f"{fleet}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    replicas = {s.labels["replica"] for s in families["paged_kv_blocks_total"].samples}
    assert len(replicas) == 2, replicas
    assert {s.value for s in families["paged_kv_blocks_total"].samples} == {ENGINE["num_blocks"]}
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(f"{fleet}/metrics", timeout=30)
    assert denied.value.code == 401


def test_paged_chat_remote(fleet):
    """PagedChat(base_url=...) invokes and streams through the fleet."""
    from sdk.integrations.langchain import PagedChat

    chat = PagedChat(base_url=f"{fleet}/v1", api_key=KEY, temperature=0, max_tokens=5)
    try:
        reply = chat.invoke([("system", "You are terse."), ("human", "Count to five.")])
        assert reply.usage_metadata["output_tokens"] == 5
        streamed = "".join(c.content for c in chat.stream([("system", "You are terse."), ("human", "Count to five.")]))
        assert streamed == reply.content
    finally:
        chat.client.close()


def test_prefix_hit_rate_matches_one_engine(fleet, model_dir, live_server):
    """4 system prompts x 32 questions: the fleet's hit rate is within 5 points of one engine's; round-robin reported.

    The one-engine and round-robin figures come from fresh in-process servers of the same model
    and engine settings: one server, and two taken in turn.
    """
    routed = asyncio.run(measure([fleet], KEY))
    single = asyncio.run(measure([live_server(create_app(model_dir, api_key=KEY, **ENGINE)).root], KEY))
    pair = [live_server(create_app(model_dir, api_key=KEY, **ENGINE)).root for _ in range(2)]
    round_robin = asyncio.run(measure(pair, KEY))
    report = f"hit rate: prefix-affinity {routed.hit_rate:.3f}, one engine {single.hit_rate:.3f}, round-robin {round_robin.hit_rate:.3f}"
    print(report)
    assert routed.num_requests == single.num_requests == round_robin.num_requests == 128
    assert routed.hit_rate >= single.hit_rate - 0.05, report
    assert round_robin.hit_rate < single.hit_rate, report


def test_each_replica_audits_to_a_log_of_its_own(fleet, audit_path):
    """--audit-log PATH: one intact hash chain per replica, PATH.<replica id>, holding the fleet's requests."""
    from sdk.hooks import AuditLog

    logs = sorted(audit_path.parent.glob(f"{audit_path.name}.*"))
    assert len(logs) == 2, logs
    assert all(AuditLog.verify(log) > 0 for log in logs)


async def test_killed_replica_every_request_ends_and_fleet_recovers(fleet):
    """Kill a replica under load: each request gets a result or a retryable error; Ray brings the replica back."""
    import openai

    await _whole()
    client = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=_patience())
    model = (await client.models.list()).data[0].id
    before = _replica_names()
    assert len(before) == 2
    started = asyncio.Event()

    async def one(i: int, stream: bool) -> str:
        messages = [{"role": "user", "content": f"Tell a long story number {i}."}]
        extra = {"ignore_eos": True}
        try:
            if not stream:
                await client.chat.completions.create(model=model, messages=messages, max_tokens=96, extra_body=extra)
                return "ok"
            events = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=96, stream=True, extra_body=extra
            )
            async for _ in events:
                started.set()
            return "ok"
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.body["code"] == "replica_unavailable", exc
            return "retryable"
        except openai.APIError as exc:  # an error event in a stream that had started
            assert exc.body["code"] == "replica_failed", exc
            return "retryable"

    tasks = [asyncio.ensure_future(one(i, stream=i % 2 == 0)) for i in range(12)]
    await asyncio.wait_for(started.wait(), _patience())
    ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), _patience())
    assert set(outcomes) <= {"ok", "retryable"} and "ok" in outcomes, outcomes

    await _whole(killed=[before[0]])
    replies = await asyncio.gather(*(
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=2)
        for i in range(4)
    ))  # fmt: skip
    assert all(r.usage.completion_tokens == 2 for r in replies)


def test_serve_command_imports_without_ray():
    """``paged serve`` (no --replicas) never imports ray: the extra stays optional."""
    code = (
        "import sys, integrations.cli, integrations.serve_command; "
        "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules), 'ray imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_tensor_parallel_replica_is_one_packed_placement_group(model_dir):
    """A replica of N ranks reserves a bundle per rank, on one node where it spawns its ranks and by the engine's
    ray_placement_strategy where they are Ray actors (in its bundles); its actor takes the first bundle."""
    from engine import EngineConfig
    from integrations.ray.app import replica_resources
    from integrations.ray.config import app_builder

    assert replica_resources(1.0, 0.0, EngineConfig()) == {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0}}
    assert replica_resources(2.0, 1.0, EngineConfig(tensor_parallel_size=2)) == {
        "ray_actor_options": {"num_cpus": 2.0, "num_gpus": 1.0},
        "placement_group_bundles": [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}],
        "placement_group_strategy": "STRICT_PACK",
    }
    assert replica_resources(0.5, 0.0, EngineConfig(pipeline_parallel_size=2))["placement_group_bundles"] == [
        {"CPU": 0.5}, {"CPU": 0.5}
    ]  # fmt: skip
    on_ray = EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert replica_resources(0.5, 0.0, on_ray) == {
        "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0.0},
        "placement_group_bundles": [{"CPU": 0.5}] * 4,
        "placement_group_strategy": "PACK",
    }
    spread = EngineConfig(pipeline_parallel_size=2, distributed_executor_backend="ray", ray_placement_strategy="SPREAD")
    assert replica_resources(0.5, 0.0, spread)["placement_group_strategy"] == "SPREAD"
    # Ray Serve takes these options (the actor must fit in the first bundle)
    app_builder({"model": model_dir, "replicas": 2, "replica_cpus": 0.5, "tensor_parallel_size": 2})
    app_builder({"model": model_dir, "replicas": 2, "replica_cpus": 0.5, "pipeline_parallel_size": 2,
                 "distributed_executor_backend": "ray", "ray_placement_strategy": "SPREAD"})  # fmt: skip


def _patience() -> float:
    """Seconds a fault test waits for the fleet (a replacement, a stream that goes on): see MIN_PATIENCE."""
    return max(MIN_PATIENCE, 2 * STARTED["seconds"])


async def _whole(killed: Sequence[str] = ()) -> None:
    """Waits until Serve's controller has the engine deployment healthy, its replicas two running ones, neither of
    them ``killed`` (actor names).

    The controller notices a killed replica at its next health check (until then it still counts
    it as running, though its actor's name is gone), stops it and starts a replacement; until the
    replacement's engine serves, the deployment is unhealthy.
    """
    deadline = time.monotonic() + _patience()
    while True:
        engine = (await asyncio.to_thread(serve.status)).applications[APP].deployments["engine"]
        replicas = await _replicas()
        running = {name for name, state in replicas.items() if state == "RUNNING"}
        if engine.status == "HEALTHY" and len(replicas) == len(running) == 2 and not set(killed) & running:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the fleet is not whole after {_patience():.0f} s: {engine}, replicas {replicas}, killed {killed}")
        await asyncio.sleep(STATUS_POLL)


async def _replicas() -> dict[str, str]:
    """The engine replicas Serve's controller holds: actor name -> state (``RUNNING``, ``STARTING``, ``STOPPING``...)."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = await controller.get_serve_instance_details.remote()
    return {r["actor_name"]: r["state"] for r in details["applications"][APP]["deployments"]["engine"]["replicas"]}


@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_a_replica_killed_mid_stream_leaves_the_clients_stream_whole(fleet, tmp_path, route):
    """The replica serving a stream is killed once the client got 6 tokens: the stream goes on on the other replica,
    chunk for chunk the unkilled run's (greedy and seeded), with one id, no error, and the whole run's usage."""
    import openai

    await _whole()  # NOTE: the stream goes on on the replica that is not killed: it must be running
    client = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=_patience())
    model = (await client.models.list()).data[0].id
    samplings = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 11}}
    opening = 1 if route == "chat" else 0  # a chat stream's first chunk carries the role, no token

    def create(sampling: dict, **extra):
        # NOTE: one prompt for both streams: prefix affinity sends them to one replica, the one killed. Each
        # prompt holds full blocks (a prompt under one block has no hash to route by: its streams go anywhere)
        common = {
            "model": model, "max_tokens": 48, "stream": True, "stream_options": {"include_usage": True},
            "extra_body": {"ignore_eos": True}, **sampling, **extra,
        }  # fmt: skip
        if route == "chat":
            messages = [{"role": "user", "content": "Tell a long story about a lighthouse."}]
            return client.chat.completions.create(messages=messages, **common)
        return client.completions.create(prompt=PROMPT, **common)

    received = {name: asyncio.Event() for name in samplings}

    async def held_stream(name: str, gate: Path) -> list:
        """The stream's chunks; ``received[name]`` is set once it has its opening and HOLD_AFTER tokens."""
        gate.mkdir()
        chunks = []
        async for chunk in await create(samplings[name], extra_headers={GATE_HEADER: str(gate)}):
            chunks.append(chunk)
            if len(chunks) == opening + HOLD_AFTER:
                received[name].set()
        return chunks

    continued = _continued(fleet)
    unkilled = {name: [c async for c in await create(s)] for name, s in samplings.items()}
    gates = {name: tmp_path / name for name in samplings}
    tasks = {name: asyncio.ensure_future(held_stream(name, gate)) for name, gate in gates.items()}
    holders = set()
    for name, gate in gates.items():
        await asyncio.wait_for(received[name].wait(), _patience())
        holders.add(await _held_on(gate))
    for name in holders:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for gate in gates.values():
        (gate / "go").touch()
    killed = {name: await asyncio.wait_for(task, _patience()) for name, task in tasks.items()}

    for name, chunks in killed.items():
        assert {c.id for c in chunks} == {chunks[0].id}, name
        assert _deltas(chunks) == _deltas(unkilled[name]), name
        assert len(_deltas(chunks)) > opening + HOLD_AFTER
        usage, expected = chunks[-1].usage, unkilled[name][-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (expected.prompt_tokens, 48), name
    now = _continued(fleet)
    assert sum(n - continued.get(replica, 0) for replica, n in now.items()) == len(samplings)  # both went on elsewhere
    await _whole(killed=sorted(holders))


async def test_a_replica_stopped_gracefully_finishes_or_hands_over_its_streams(fleet, tmp_path):
    """Scaling down to one replica while streams run on both: a stream the stopped replica can finish within Serve's
    graceful shutdown timeout finishes there; one it cannot goes on on the other replica when Serve stops it at the
    deadline. Each equals the run nothing stopped; the fleet serves on and scales back up."""
    import openai

    await _whole()
    client = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=_patience())
    model = (await client.models.list()).data[0].id

    def create(i: int, **extra):
        # NOTE: a first block of its own: a stream goes to the least-loaded replica, not where another one runs
        return client.completions.create(
            model=model, prompt=f"Story {i}. {PROMPT}", max_tokens=32, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, **extra,
        )  # fmt: skip

    async def held_stream(i: int) -> list:
        return [chunk async for chunk in await create(i, extra_headers={GATE_HEADER: str(tmp_path / str(i))})]

    holders: dict[int, str] = {}
    tasks: dict[int, asyncio.Future] = {}
    for i in range(12):  # NOTE: until each replica holds two streams (a stream goes to the less loaded one)
        (tmp_path / str(i)).mkdir()
        tasks[i] = asyncio.ensure_future(held_stream(i))
        holders[i] = await _held_on(tmp_path / str(i))
        if len(set(holders.values())) == 2 and min(Counter(holders.values()).values()) >= 2:
            break
    assert min(Counter(holders.values()).values()) >= 2, holders
    unstopped = {i: _deltas([c async for c in await create(i)]) for i in tasks}
    continued = _continued(fleet)

    await _scale(1)
    stopping = await _stopping()
    assert stopping in holders.values(), (stopping, holders)
    drained, *handed_over = [i for i, name in holders.items() if name == stopping]
    for i in [i for i, name in holders.items() if name != stopping] + [drained]:
        (tmp_path / str(i) / "go").touch()
    streamed = {drained: _deltas(await asyncio.wait_for(tasks[drained], _patience()))}
    async with asyncio.timeout(_patience()):
        while stopping in _replica_names():  # NOTE: the held streams keep it draining until Serve's deadline
            await asyncio.sleep(STATUS_POLL)
    for i in handed_over:
        (tmp_path / str(i) / "go").touch()
    streamed |= {i: _deltas(await asyncio.wait_for(task, _patience())) for i, task in tasks.items() if i != drained}
    assert streamed == unstopped
    now = _continued(fleet)
    assert sum(n - continued.get(replica, 0) for replica, n in now.items()) == len(handed_over)

    await _scale(2)
    await _whole()


async def _held_on(gate: Path) -> str:
    """The actor name of the replica that holds the gated stream, once the client has its HOLD_AFTER tokens."""
    async with asyncio.timeout(_patience()):
        while not (gate / "held").exists():  # NOTE: the hook writes it once the client has HOLD_AFTER tokens
            await asyncio.sleep(0.01)
    return (gate / "held").read_text()


async def _scale(num_replicas: int) -> None:
    """Sets the engine deployment's replicas as an external scaler does (Serve's scale API calls the controller so)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    await controller.update_deployment_replicas.remote(DeploymentID(name="engine", app_name=APP), num_replicas)


async def _stopping() -> str:
    """The actor name of the engine replica Serve is stopping, once its controller reports one."""
    async with asyncio.timeout(_patience()):
        while True:
            stopping = [name for name, state in (await _replicas()).items() if state == "STOPPING"]
            if stopping:
                return stopping[0]
            await asyncio.sleep(STATUS_POLL)


def _continued(fleet: str) -> dict[str, float]:
    """``paged_requests_continued_total`` of each replica that answers the fleet's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(f"{fleet}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    samples = families["paged_requests_continued"].samples
    return {s.labels["replica"]: s.value for s in samples if s.name.endswith("_total")}


def _deltas(chunks: list) -> list[tuple]:
    """Each chunk's choice: a chat delta's role and content, or a completion's text; its finish reason."""
    out = []
    for choice in (c.choices[0] for c in chunks if c.choices):
        delta = getattr(choice, "delta", None)
        out.append(((delta.role, delta.content) if delta is not None else choice.text, choice.finish_reason))
    return out
