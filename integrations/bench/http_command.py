"""``paged bench --base-url URL``: the workloads against a running OpenAI-compatible server.

One invocation runs one arrival pattern: every request at once (the default, the in-process
protocol), ``--request-rate R`` (open-loop Poisson, seeded by ``--seed``) or a
``--concurrency`` sweep (a closed loop per level). ``--slo-ttft/--slo-itl/--slo-e2e`` add the
share of requests within all the bounds given and the goodput (good requests/s).
``--compare-in-process`` also runs the same workload on an in-process engine built from this
command's engine flags (set them as the server's) and reports the HTTP run's throughput as a
ratio of it: what HTTP, SSE and the server's SDK layer cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from integrations.bench import http_runs
from integrations.bench.report import RunResult, build_report, format_http, format_table
from integrations.engine_flags import FlagError, engine_config, engine_kwargs

HTTP_WORKLOADS = ("shared-prefix", "distinct", "rag")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--base-url`` options of ``paged bench`` (``--concurrency`` is shared with the sweep workload)."""
    group = parser.add_argument_group("HTTP load test (--base-url)")
    group.add_argument(
        "--base-url", default=None, metavar="URL",
        help="benchmark this running OpenAI-compatible server (paged serve, vLLM, ...) instead of an in-process engine",
    )  # fmt: skip
    group.add_argument(
        "--api-key", default=os.environ.get("PAGED_API_KEY"), help="the server's key (default: $PAGED_API_KEY)"
    )
    group.add_argument(
        "--served-model-name", default=None, metavar="ID",
        help="model id to request (default: the first /v1/models lists)",
    )
    group.add_argument(
        "--request-rate", type=_positive_float, default=None, metavar="R",
        help="open-loop Poisson arrivals at R requests/s (seeded by --seed); default: every request at once",
    )  # fmt: skip
    group.add_argument("--slo-ttft", type=_positive_float, default=None, metavar="S", help="TTFT bound (s)")
    group.add_argument("--slo-itl", type=_positive_float, default=None, metavar="S", help="mean inter-token bound (s)")
    group.add_argument("--slo-e2e", type=_positive_float, default=None, metavar="S", help="end-to-end bound (s)")
    group.add_argument(
        "--compare-in-process", action="store_true",
        help="also run the workload on an in-process engine (this command's engine flags) and report the ratio",
    )  # fmt: skip


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse combinations ``--base-url`` cannot run, before anything connects.

    Raises:
        FlagError: naming the flag and what to use instead.
    """
    if args.workload not in HTTP_WORKLOADS:
        raise FlagError(
            f"--workload {args.workload} does not run over HTTP; use one of {', '.join(HTTP_WORKLOADS)} "
            "(--request-rate and --concurrency give the poisson and sweep arrival patterns)"
        )
    if args.compare:
        raise FlagError("--compare runs in-process baselines; with --base-url use --compare-in-process")
    if args.request_rate is not None and args.concurrency is not None:
        raise FlagError("--request-rate and --concurrency are two arrival patterns; pass one")
    if args.compare_in_process and (args.request_rate is not None or args.concurrency is not None):
        raise FlagError("--compare-in-process compares the all-at-once run; drop --request-rate / --concurrency")
    if args.compare_in_process:
        engine_config(args)


def refuse_http_flags(args: argparse.Namespace) -> None:
    """Without ``--base-url``: refuse the flags only an HTTP run reads (``FlagError``) rather than ignore them."""
    given = [
        flag for flag, value in (
            ("--request-rate", args.request_rate), ("--slo-ttft", args.slo_ttft), ("--slo-itl", args.slo_itl),
            ("--slo-e2e", args.slo_e2e), ("--served-model-name", args.served_model_name),
            ("--compare-in-process", args.compare_in_process or None),
        ) if value is not None
    ]  # fmt: skip
    if given:
        raise FlagError(f"{', '.join(given)} need --base-url (an HTTP load test)")


def run(args: argparse.Namespace) -> int:
    """Run the HTTP benchmark ``args`` describes; prints the tables and writes ``--json``.

    Raises:
        FlagError: a combination of flags that cannot run (``paged`` reports it as a usage error).
        ServerUnusable: the server is unreachable, refuses the key, or fails the warm-up request.
    """
    check_arguments(args)
    from tqdm.auto import tqdm

    from integrations.bench.machine import machine_info
    from integrations.bench.workloads import workload_turns

    turns, description = workload_turns(args.workload, args.num_requests)
    slo = http_runs.Slo(args.slo_ttft, args.slo_itl, args.slo_e2e)
    bar = tqdm(unit="tok", desc=f"paged bench {args.workload} over HTTP", disable=args.no_progress)
    target, runs = asyncio.run(_load(args, turns, bar.update))
    http_results = [run.to_run_result(f"HTTP, {run.load}") for run in runs]
    results, engine_fields, ratio = list(http_results), None, None
    if args.compare_in_process:
        bar.set_postfix_str("in-process engine")
        engine_fields, in_process = _in_process(args, turns, bar.update)
        results.insert(0, in_process)
        ratio = http_results[0].tokens_per_s / in_process.tokens_per_s if in_process.tokens_per_s else None
    bar.close()
    http = {
        "base_url": target.base,
        "model": target.model,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "e2e_s": slo.e2e_s},
        "runs": [run.summary(slo) for run in runs],
        "in_process_ratio": ratio,
    }
    submitted = (
        f"poisson arrivals at {args.request_rate:g} req/s, seed {args.seed}" if args.request_rate is not None
        else f"closed loop at concurrency {', '.join(map(str, args.concurrency))}" if args.concurrency is not None
        else "all at once"
    )  # fmt: skip
    report = build_report(
        results,
        workload={
            "name": args.workload,
            "description": description,
            "num_requests": len(turns),
            "num_prompt_tokens": http_results[0].num_prompt_tokens,
        },
        machine=machine_info(),
        protocol={
            "model": target.model,
            "base_url": target.base,
            "engine": engine_fields,
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": True,
            "submitted": submitted,
        },
        http=http,
    )
    print(  # noqa: T201
        f"\n{description}: {len(turns)} requests to {target.base} ({target.model}), {submitted}, "
        f"{args.max_tokens} new tokens each\n\n{format_table(report)}\n\n{format_http(http)}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


async def _load(
    args: argparse.Namespace, turns: list[dict[str, str]], progress: http_runs.Progress
) -> tuple[http_runs.Target, list[http_runs.LoadRun]]:
    levels = args.concurrency or []
    async with http_runs.session(max([len(turns), *levels])) as client:
        target = await http_runs.resolve_target(client, args.base_url, args.api_key, args.served_model_name)
        await http_runs.warm_up(client, target)
        if args.request_rate is not None:
            rate, seed = args.request_rate, args.seed
            runs = [await http_runs.poisson(client, target, turns, args.max_tokens, rate, seed, progress)]
        elif levels:
            runs = [await http_runs.closed_loop(client, target, turns, args.max_tokens, c, progress) for c in levels]
        else:
            runs = [await http_runs.at_once(client, target, turns, args.max_tokens, progress)]
    return target, runs


def _in_process(
    args: argparse.Namespace, turns: list[dict[str, str]], progress: http_runs.Progress
) -> tuple[dict[str, Any], RunResult]:
    """The same turns, templated by the local model's tokenizer, through ``run_offline`` on a fresh engine."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from engine.loader import resolve_model
    from integrations.bench.engine_runs import EngineSpec, run_offline
    from integrations.bench.workloads import apply_chat_template

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    fields = engine_kwargs(args)
    model = fields.pop("model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(model))
    prompts = [apply_chat_template(tokenizer, t["system"], t["user"]) for t in turns]
    return fields, run_offline(EngineSpec(model, fields), prompts, args.max_tokens, progress)
