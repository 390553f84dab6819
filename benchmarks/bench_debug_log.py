"""Cost of the ``engine.debug`` step log: decode steps with the log on and off, interleaved step by step.

One batch of requests decodes; the log is switched on and off between steps (on, off, off, on,
...), so both modes see the same batch and the same machine load, and each step is timed.
The log writes to a stream on ``os.devnull`` (formatting and I/O paid, no terminal). Printed:
the median step time in each mode and their ratio (on / off), and the cost of the one check
the engine makes per step while the log is off.

    python benchmarks/bench_debug_log.py                          # bundled SmolLM2
    python benchmarks/bench_debug_log.py --model PATH --steps 400   # e.g. a tiny test model
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import timeit

from engine import Engine, SamplingParams, debug_log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed")
    args = parser.parse_args()

    engine = Engine(args.model)
    logger = debug_log.logger
    sink = open(os.devnull, "w")  # noqa: SIM115 - held for the whole run
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False

    params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", list(range(1000 + 100 * i, 1032 + 100 * i)), params)
    engine.step()  # the prefill
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.steps):
        on = i % 4 in (0, 3)
        logger.setLevel(logging.DEBUG if on else logging.WARNING)
        start = time.perf_counter()
        engine.step()
        times[on].append(time.perf_counter() - start)
    logger.setLevel(logging.WARNING)
    engine.abort_request([f"r{i}" for i in range(args.requests)])

    off, on = statistics.median(times[False]), statistics.median(times[True])
    check_ns = min(timeit.repeat(debug_log.is_enabled, number=100_000, repeat=5)) / 100_000 * 1e9
    print(f"model {engine.model_name}: {args.requests} requests decoding, {args.steps} steps timed")
    print(f"median step: off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms, on/off {on / off:.3f}")
    print(f"while off, the per-step check: {check_ns:.0f} ns ({check_ns * 1e-9 / off * 100:.4f}% of a step)")


if __name__ == "__main__":
    main()
