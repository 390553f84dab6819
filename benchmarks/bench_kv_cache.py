"""Micro-benchmark of the KV cache manager's bookkeeping (pure Python, no model, no tensors).

What is measured, per request: CPU time of this process (``time.process_time``) around
the manager calls only, so other load on the machine does not inflate the figures
(the manager is single-threaded and never waits); building the token lists is excluded:

- admit:  ``get_computed_blocks`` + ``allocate_slots`` for the whole prompt (hashing the
          uncached blocks, taking hit blocks, allocating and registering the rest);
- decode: ``--decode-tokens`` steps of one token each, one ``allocate_slots`` per step,
          interleaved across the running batch as the scheduler does;
- free:   ``free`` of the request.

Requests run in waves of ``--batch`` concurrent requests over a pool sized for one wave,
so from the second wave on the freed tails of earlier waves are evicted. Every request
shares the first ``--prefix-len`` tokens (a system prompt) and has a unique tail.

Usage: ``python benchmarks/bench_kv_cache.py [--num-requests 10000] [--no-enable-prefix-caching]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.kv_cache_manager import KVCacheManager  # noqa: E402


def run(
    num_requests: int,
    prompt_len: int,
    prefix_len: int,
    decode_tokens: int,
    batch: int,
    block_size: int,
    enable_prefix_caching: bool,
) -> dict[str, float]:
    blocks_per_request = -(-(prompt_len + decode_tokens) // block_size)
    kv = KVCacheManager(batch * blocks_per_request + 1, block_size, enable_prefix_caching)
    prefix = list(range(100_000, 100_000 + prefix_len))
    t_admit = t_decode = t_free = 0.0
    for first in range(0, num_requests, batch):
        req_ids = [f"req-{i}" for i in range(first, min(first + batch, num_requests))]
        prompts = {
            r: prefix + [(i * 7919 + j) % 49_152 for j in range(prompt_len - prefix_len)]
            for i, r in enumerate(req_ids, start=first)
        }
        t0 = time.process_time()
        for r in req_ids:
            tokens = prompts[r]
            computed = kv.get_computed_blocks(r, tokens)
            n = computed.num_computed_tokens
            if kv.allocate_slots(r, tokens, n, len(tokens) - n, computed) is None:
                raise RuntimeError("pool too small for one wave")
        t1 = time.process_time()
        for step in range(decode_tokens):
            for r in req_ids:
                tokens = prompts[r]
                tokens.append(step)
                kv.allocate_slots(r, tokens, len(tokens) - 1, 1)
        t2 = time.process_time()
        for r in req_ids:
            kv.free(r)
        t3 = time.process_time()
        t_admit += t1 - t0
        t_decode += t2 - t1
        t_free += t3 - t2
    kv.check_integrity()
    stats = kv.stats()
    return {
        "admit_us": t_admit / num_requests * 1e6,
        "decode_step_us": t_decode / (num_requests * decode_tokens) * 1e6 if decode_tokens else 0.0,
        "free_us": t_free / num_requests * 1e6,
        "total_us": (t_admit + t_decode + t_free) / num_requests * 1e6,
        "hit_rate": stats.prefix_cache_hit_rate,
        "evictions": stats.num_evictions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--prompt-len", type=int, default=1_000)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256, help="concurrent requests per wave")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    result = run(
        args.num_requests, args.prompt_len, args.prefix_len, args.decode_tokens, args.batch, args.block_size,
        args.enable_prefix_caching,
    )
    print(
        f"{args.num_requests} requests x {args.prompt_len} tokens ({args.prefix_len} shared), "
        f"{args.decode_tokens} decode steps, batch {args.batch}, block_size {args.block_size}, "
        f"prefix caching {'on' if args.enable_prefix_caching else 'off'}"
    )
    print(
        f"per request: admit {result['admit_us']:.1f} us, decode step {result['decode_step_us']:.2f} us, "
        f"free {result['free_us']:.1f} us, total {result['total_us']:.1f} us"
    )
    print(f"prefix-cache hit rate {result['hit_rate']:.3f}, evictions {result['evictions']}")


if __name__ == "__main__":
    main()
