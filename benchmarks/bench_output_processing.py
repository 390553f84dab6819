"""Micro-benchmark of the engine's output processing per step (no model, no tensors).

What is measured, per request-step: CPU time of this process (``time.process_time``) around
what the engine does with the tokens a step sampled, for ``--num-requests`` requests that
each generate ``--num-tokens`` tokens in lockstep:

- deltas:     ``OutputProcessor.process`` (detokenize, stop strings, logprobs), the tokens
              appended, then ``OutputProcessor.deltas`` per request: what ``Engine.step_deltas``
              and every streaming path (``AsyncEngine.stream``, the SDK, the server) run on;
- cumulative: the same, then ``OutputProcessor.make_output`` per request: the copy of the
              output so far that ``Engine.step`` and ``AsyncEngine.generate`` give.

The first and last 64 steps are reported apart: a cost that grows with the output shows there.

Usage: ``python benchmarks/bench_output_processing.py [--num-requests 64] [--num-tokens 512] [--logprobs 5] [--stop '###']``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.output_processor import OutputProcessor, ParentRequest  # noqa: E402
from engine.request import Request, RequestStatus  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def run(tokenizer, script: list[int], args: argparse.Namespace, cumulative: bool) -> list[float]:
    """Seconds of CPU per step."""
    params = SamplingParams(max_tokens=len(script), ignore_eos=True, logprobs=args.logprobs, stop=tuple(args.stop))
    processor = OutputProcessor(tokenizer)
    parents = []
    for i in range(args.num_requests):
        request = Request(f"r{i}", [1, 2, 3, 4, 5], params)
        request.status = RequestStatus.RUNNING
        processor.add_request(request)
        parents.append(ParentRequest(request.req_id, request.prompt_token_ids, [request]))
    rows = [parent.children[0] for parent in parents]
    times = []
    for step, token in enumerate(script):
        row_logprobs = None
        if args.logprobs is not None:  # the sampler's row: the sampled token, then the top k by rank
            row_logprobs = [(token, -0.5, 1)] + [(token + k + 1, -1.0 - k, k + 2) for k in range(args.logprobs)]
        start = time.process_time()
        processor.process(rows, [token] * len(rows), [row_logprobs] * len(rows), {}, lambda *_: None)
        for request in rows:
            request.append_token(token)
            if step == len(script) - 1:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        for parent in parents:
            if cumulative:
                processor.make_output(parent)
            else:
                processor.deltas(parent)
        times.append(time.process_time() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=512)
    parser.add_argument("--logprobs", type=int, default=None, help="candidates per token (default: no logprobs)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (never met); repeatable")
    parser.add_argument("--rounds", type=int, default=3, help="the best of this many runs is reported")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True)
    text = Path(__file__).read_text()
    script = (tokenizer.encode(text) * (args.num_tokens // 100 + 1))[: args.num_tokens]
    per = 1e6 / args.num_requests
    best = {}
    for name, cumulative in (("deltas", False), ("cumulative", True)):
        run(tokenizer, script[:64], args, cumulative)  # warm up
        best[name] = min((run(tokenizer, script, args, cumulative) for _ in range(args.rounds)), key=sum)
        times = best[name]
        print(
            f"{name:>10}: {sum(times) / len(times) * per:7.2f} us per request-step "
            f"(first 64 steps {sum(times[:64]) / 64 * per:.2f}, last 64 {sum(times[-64:]) / 64 * per:.2f})"
        )
    print(f"cumulative / deltas: {sum(best['cumulative']) / sum(best['deltas']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
