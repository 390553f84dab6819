"""Micro-benchmark: the cost of one Scheduler.schedule() with a deep waiting queue.

Sets up ``--running`` decoding requests and ``--waiting`` queued ones over a real
KVCacheManager (no model: tokens are fed back by hand), then times ``schedule()`` +
``update_from_output()`` per step. With ``max_num_seqs`` equal to the running count the
waiting queue cannot be admitted, which is the case that must not scan it.

    python benchmarks/bench_scheduler.py --waiting 10000 --running 256
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.request import Request
from engine.sampling_params import SamplingParams


def build(num_running: int, num_waiting: int, prompt_len: int, block_size: int) -> Scheduler:
    num_blocks = num_running * (prompt_len // block_size + 64) + 16
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=num_running, max_num_batched_tokens=1 << 20)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(num_running + num_waiting):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, priority=i % 3, arrival_seq=i))
    step(scheduler)  # admits the first num_running (their prefill); the rest stay waiting
    assert scheduler.num_running == num_running and scheduler.num_waiting == num_waiting
    return scheduler


def step(scheduler: Scheduler) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = scheduler.schedule()
    t1 = time.perf_counter()
    rows = [scheduler.requests[r.req_id] for r in out.scheduled if r.needs_logits]
    scheduler.update_from_output(rows, [1] * len(rows))
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    scheduler = build(args.running, args.waiting, args.prompt_len, args.block_size)
    sched, update = [], []
    for _ in range(args.steps):
        s, u = step(scheduler)
        sched.append(s)
        update.append(u)
    sched.sort()
    ms = lambda x: f"{x * 1e3:.3f} ms"  # noqa: E731
    print(f"running={args.running} waiting={args.waiting} steps={args.steps}")
    print(f"schedule():           median {ms(statistics.median(sched))}  p99 {ms(sched[int(0.99 * len(sched)) - 1])}")
    print(f"update_from_output(): median {ms(statistics.median(update))}")


if __name__ == "__main__":
    main()
