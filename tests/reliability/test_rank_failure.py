"""Self-healing under tensor and pipeline parallelism: a rank that fails a step, or whose process (a tensor-parallel
rank, a pipeline stage) is killed mid-stream, ends every request in flight with an error, the dead engine returns
every block, and a fresh group (fresh rank processes) serves."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine import AsyncEngine, Engine, SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.errors import WorkerGroupFailed
from engine.supervisor import RestartPolicy
from sdk import AsyncClient
from sdk.errors import EngineRestarting
from sdk.transport import InProcessTransport
from tests.reliability.conftest import ENGINE_CONFIG, stream_until_restart

PROMPTS = [list(range(300 + 37 * i, 300 + 37 * i + 5 + i % 7)) for i in range(6)]
NUM_TOKENS = 60  # far more steps than the rank survives



@pytest.mark.parametrize("group", [
    pytest.param({"tensor_parallel_size": 2}, id="tensor-parallel"),
    pytest.param({"pipeline_parallel_size": 2}, id="pipeline-parallel"),
])  # fmt: skip
async def test_killing_a_rank_mid_stream_fails_every_request_returns_every_block_and_a_fresh_group_serves(
    model_dir, quiescent, group
) -> None:
    """Rank 1 (the second tensor-parallel rank, or the last pipeline stage) killed while 6 streams run: each ends
    with EngineRestarting naming the failed step; the dead engine's pool is whole; the fresh engine runs on a new
    rank process and completes a request."""
    kind = "tensor-parallel" if "tensor_parallel_size" in group else "pipeline-parallel"
    engine = AsyncEngine(str(model_dir), restart=RestartPolicy(backoff_s=0.05), **group, **ENGINE_CONFIG)
    try:
        dead = engine.engine
        rank1 = dead.runner.workers.processes[0]
        client = AsyncClient(transport=InProcessTransport(engine))
        tasks = [asyncio.ensure_future(stream_until_restart(client, p, NUM_TOKENS)) for p in PROMPTS]
        while engine.stats()["generation_tokens"] < 2 * len(PROMPTS):
            await asyncio.sleep(0.01)
        os.kill(rank1.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30.0)
        for received, error in results:
            assert isinstance(error, EngineRestarting) and f"{kind} step failed" in str(error)
            assert 0 < received < NUM_TOKENS
        dead.kv.check_integrity()
        assert dead.kv.num_free_blocks == dead.kv.num_blocks and not dead.has_unfinished_requests()
        while engine.health().status != "running":
            await asyncio.sleep(0.05)
        assert engine.health().restarts == 1
        result = await client.complete(PROMPTS[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(result.token_ids) == 4
        fresh_rank1 = engine.engine.runner.workers.processes[0]
        assert fresh_rank1.pid != rank1.pid and fresh_rank1.is_alive() and not rank1.is_alive()
        await quiescent(engine)
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()


def test_a_rank_that_fails_a_step_fails_every_request_with_a_typed_error_and_returns_every_block(model_dir) -> None:
    """Rank 1 alone fails a step (a request without blocks, sent to it only): the engine's next step raises
    WorkerGroupFailed, every request (running or waiting) fails with it, the pool is whole, the rank is gone."""
    engine = Engine(str(model_dir), tensor_parallel_size=2, **{**ENGINE_CONFIG, "max_num_seqs": 2})
    try:
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(None, p, params) for p in PROMPTS[:3]]
        engine.step()
        engine.runner.workers.send(SchedulerOutput([ScheduledRequest("bad", [1], 0, [], True)]))
        with pytest.raises(WorkerGroupFailed, match="tensor-parallel step failed"):
            engine.step()
        failures = engine.pop_failures()
        assert sorted(failures) == sorted(ids) and all(isinstance(e, WorkerGroupFailed) for e in failures.values())
        assert not engine.has_unfinished_requests()
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert not engine.runner.workers.is_alive
    finally:
        engine.runner.workers.close()
