"""``paged bench``: the engine against the alternatives a user would pick, in one run, on one machine.

Protocol (the same for every contender): greedy decoding, exactly ``--max-tokens`` new
tokens per request (EOS ignored), every request submitted at once, output tokens/s =
total new tokens / wall time from the first submit to the last token.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from integrations.bench import http_command, llamacpp_runs, vllm_runs
from integrations.bench.machine import machine_info
from integrations.bench.records import RESULTS_FILE
from integrations.bench.workloads import WORKLOADS
from integrations.engine_flags import FlagError, add_engine_arguments, engine_config, engine_kwargs

logger = logging.getLogger(__name__)

OFFLINE_WORKLOADS = ("shared-prefix", "distinct", "rag")  # those --compare runs the baselines on
BATCH1 = "batch1"  # one request at a time, against llama-bench
EMBED = "embed"  # embedding throughput and latency, against sentence-transformers (integrations.bench.embed)
SWEEP_LEVELS = [1, 2, 4, 8, 16, 32, 64, 128]  # --workload sweep without --concurrency
DEFAULT_PROMPT_TOKENS = 512  # batch1's timed prefill without --prompt-tokens or --depth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``paged bench`` options, and every engine flag (the engine's runs get them all)."""
    parser.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    parser.add_argument("--num-requests", type=_positive_int, default=64)
    parser.add_argument("--max-tokens", type=_positive_int, default=128, help="new tokens per request")
    parser.add_argument("--compare", action="store_true", help="also run the baselines (--baselines)")
    parser.add_argument(
        "--baselines",
        type=_baseline_list,
        default=["one-by-one", "static-16", "continuous"],
        help="comma-separated baselines for --compare: one-by-one, static-N (e.g. static-64), continuous "
        "(Hugging Face), vllm (vLLM's CPU build, see --vllm-python), llamacpp (llama.cpp on the same GGUF: "
        "llama-server for the offline workloads, llama-bench for batch1; see --llamacpp-dir)",
    )
    parser.add_argument(
        "--llamacpp-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the llama.cpp build whose bin/llama-bench (batch1) or bin/llama-server (the rest) --baselines llamacpp runs "
        f"(default: ${llamacpp_runs.DIR_ENV_VAR}, else {llamacpp_runs.DEFAULT_DIR})",
    )
    parser.add_argument(
        "--llamacpp-slots", type=_positive_int, default=16, help="llama-server's parallel slots (-np), --baselines llamacpp"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=_positive_int,
        default=None,
        help="batch1: the prompt length whose prefill is timed (default: --depth where given, else 512)",
    )
    parser.add_argument(
        "--depth",
        type=_positive_int,
        default=None,
        help="batch1: time the decode with this many tokens in the cache, and (unless --prompt-tokens) the prefill of "
        "this many tokens, as llama-bench's -d and -p",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        metavar="PATH",
        help="the python of vLLM's own virtual environment, for --baselines vllm "
        "(default: $PAGED_VLLM_PYTHON, else ~/.cache/paged-peers/vllm/bin/python)",
    )
    parser.add_argument(
        "--vllm-model",
        type=Path,
        default=None,
        metavar="PATH",
        help="the Hugging Face directory vLLM serves (default: the engine's model); with a .gguf --model, the "
        "directory the file was made from, so that the engine's own blocks race vLLM's dense weights",
    )
    parser.add_argument(
        "--vllm-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="the dtype vLLM runs in (default: the engine's weights' dtype); each one's fastest dtype on a CPU can "
        "differ, e.g. the engine's bfloat16 against vLLM's float32 where the CPU's bfloat16 products are slow",
    )
    parser.add_argument(
        "--rounds",
        type=_positive_int,
        default=1,
        help="shared-prefix, distinct, rag: run every contender this many times, taking turns (the engine, then each "
        "baseline, then the engine again); each row is the contender's median round, and every round's rates and "
        "ratios to the engine's in the same round follow the table (for a machine whose speed drifts); batch1: "
        "repetitions of each measurement (their mean is the rate)",
    )
    parser.add_argument(
        "--baseline-requests",
        type=_positive_int,
        default=None,
        help="run one-by-one generation on this many requests only (its rate is per token served)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--record",
        type=Path,
        nargs="?",
        const=RESULTS_FILE,
        default=None,
        metavar="PATH",
        help="append the run, with the date, the engine's commit and this command line, to the results file that "
        f"`paged figures` renders the docs' tables from (default: {RESULTS_FILE}, from the project's folder)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write PNG plots into this folder")
    parser.add_argument("--profile", action="store_true", help="per-phase step times and a torch profiler trace")
    parser.add_argument("--profile-dir", type=Path, default=Path("bench-out"), help="where --profile writes")
    parser.add_argument("--rate", type=float, default=1.0, help="poisson: first arrival rate (requests/s)")
    parser.add_argument("--itl-bound", type=float, default=0.25, help="poisson: p99 inter-token latency bound (s)")
    parser.add_argument("--rate-trials", type=_positive_int, default=5, help="poisson: rates to try in the search")
    parser.add_argument(
        "--concurrency",
        type=_int_list,
        default=None,
        help="sweep: comma-separated concurrency levels (each level runs the engine with --max-num-seqs at it; "
        f"default: {','.join(map(str, SWEEP_LEVELS))}); with --base-url: a closed loop at each level",
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=None, help="torch CPU threads for every contender (default: torch's)"
    )
    parser.add_argument("--chunk-tokens", type=_positive_int, default=200, help="embed: tokens of each chunk")
    parser.add_argument(
        "--batch-size", type=_int_list, default=[32], help="embed: sentence-transformers' batch sizes (comma-separated)"
    )
    parser.add_argument("--queries", type=_positive_int, default=20, help="embed: single-query calls timed each")
    parser.add_argument(
        "--no-ceiling", action="store_true",
        help="skip the matmul ceiling measurement (batch1: the memory-read bound)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    http_command.add_arguments(parser)
    add_engine_arguments(parser)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(values))


def _baseline_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        known = ("one-by-one", "continuous", "sentence-transformers", vllm_runs.VLLM, llamacpp_runs.LLAMACPP)
        if name not in known and not re.fullmatch(r"static-[1-9][0-9]*", name):
            raise argparse.ArgumentTypeError(
                f"unknown baseline {name!r}; expected one-by-one, static-N (e.g. static-16), continuous, vllm, "
                "llamacpp or sentence-transformers (--workload embed)"
            )
    if not names:
        raise argparse.ArgumentTypeError("expected at least one baseline")
    return names


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; prints the tables, writes JSON and plots.

    Raises:
        FlagError: an engine flag the config refuses, ``--rounds`` beyond the offline workloads and batch1,
            ``VllmEnvMissing`` for ``--baselines vllm`` without vLLM's environment, or ``LlamaCppMissing`` for
            ``--baselines llamacpp`` without llama.cpp's binaries (``paged`` reports each as a usage error),
            before anything loads.
        VllmRunFailed, LlamaCppRunFailed: that contender's run failed (``paged`` prints the message, which
            names its log).
        ServerUnusable: with ``--base-url``, the server cannot be benchmarked (``http_command.run``).
    """
    if args.rounds > 1 and (args.base_url is not None or args.workload not in (*OFFLINE_WORKLOADS, BATCH1, EMBED)):
        raise FlagError(
            f"--rounds applies to the {', '.join(OFFLINE_WORKLOADS)} workloads, in process (and to {BATCH1}, "
            "as its repetitions)"
        )
    if (args.depth is not None or args.prompt_tokens is not None) and args.workload != BATCH1:
        raise FlagError(f"--depth and --prompt-tokens apply to --workload {BATCH1}")
    if args.workload == BATCH1 and args.compare and args.baselines != [llamacpp_runs.LLAMACPP]:
        raise FlagError(f"--workload {BATCH1} compares the engine with llama.cpp alone: pass --baselines llamacpp")
    if args.base_url is not None:
        if args.record is not None:
            raise FlagError("--record records in-process runs; a --base-url run's figures are the server's")
        return http_command.run(args)
    http_command.refuse_http_flags(args)
    config = engine_config(args)
    if args.workload == EMBED:
        return _run_embed(args)
    baseline_names = args.baselines if args.compare else []
    vllm_python = None
    if vllm_runs.VLLM in baseline_names and args.workload in OFFLINE_WORKLOADS:
        vllm_python = vllm_runs.vllm_python(args.vllm_python)
    llamacpp, gguf, skipped = None, None, {}
    if llamacpp_runs.LLAMACPP in baseline_names and args.workload in (*OFFLINE_WORKLOADS, BATCH1):
        gguf = llamacpp_runs.gguf_of(config.model)
        if gguf is None:
            skipped["llama.cpp"] = llamacpp_runs.SKIP_HF_DIR
            logger.warning("llama.cpp skipped: %s", llamacpp_runs.SKIP_HF_DIR)
        else:
            tool = llamacpp_runs.BENCH_TOOL if args.workload == BATCH1 else llamacpp_runs.SERVER_TOOL
            llamacpp = llamacpp_runs.find_llamacpp(args.llamacpp_dir, (tool,))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from tqdm.auto import tqdm

    from engine.loader import resolve_model
    from engine.worker.model_runner import model_dtypes, resolve_device
    from integrations.bench import baselines, engine_runs, profiling
    from integrations.bench.ceiling import measure_ceiling
    from integrations.bench.records import append_record, describe_model, make_record
    from integrations.bench.report import (
        build_report, format_poisson, format_profile, format_structured, format_sweep, format_table, median_round,
        round_rates,
    )
    from integrations.bench.workloads import build_workload

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(config.model)
    # NOTE: "auto" means what the engine makes of it here. The engine may compute bfloat16 weights
    # in float32 (resolve_dtypes); transformers cannot, so its baselines run the weights' dtype.
    device = resolve_device(config.device)
    hf_config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    compute_dtype, weight_dtype = model_dtypes(config.dtype, device, model_dir, hf_config)
    dtype_name = str(weight_dtype).removeprefix("torch.")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    levels = args.concurrency or SWEEP_LEVELS
    num_requests = max(args.num_requests, max(levels)) if args.workload == "sweep" else args.num_requests
    workload = build_workload(args.workload, tokenizer, num_requests)
    threads = torch.get_num_threads()

    bar = tqdm(
        total=_expected_tokens(args, workload, baseline_names),
        unit="tok",
        desc=f"paged bench {args.workload}",
        disable=args.no_progress,
    )
    engine_fields = engine_kwargs(args)
    model = engine_fields.pop("model")
    spec = engine_runs.EngineSpec(model, engine_fields)
    results: list[Any] = []
    sections: dict[str, Any] = {}  # the report's parts beside the results: batch1, poisson, sweep, structured, ...

    if args.workload == BATCH1:
        from integrations.bench.batch1 import batch1_report, engine_batch1

        depth = args.depth or 0
        prompt_tokens = args.prompt_tokens or args.depth or DEFAULT_PROMPT_TOKENS
        bar.set_postfix_str("engine")
        rows = [engine_batch1(spec, prompt_tokens, args.max_tokens, args.rounds, depth, not args.no_ceiling)]
        if llamacpp is not None:
            bar.set_postfix_str("llama-bench")
            rows.append(
                llamacpp_runs.run_llama_bench(
                    llamacpp, gguf, threads, prompt_tokens, args.max_tokens, args.rounds, depth
                )
            )
        sections["batch1"] = batch1_report(rows, prompt_tokens, args.max_tokens, threads, args.rounds, depth)
    elif args.workload == "poisson":
        sections["poisson"] = engine_runs.poisson_search(
            spec, workload.prompts, args.max_tokens, args.rate, args.itl_bound,
            args.rate_trials, bar.update,
        )
    elif args.workload == "sweep":
        hf_model = baselines.load_hf_model(model_dir, weight_dtype, device) if args.compare else None
        sections["sweep"] = engine_runs.concurrency_sweep(
            spec, workload.prompts, args.max_tokens, levels, hf_model,
            pad_token_id, bar.update,
        )
    elif args.workload == "structured":
        from integrations.bench.structured import structured_compare

        results, sections["structured"] = structured_compare(spec, workload.prompts, args.max_tokens, bar.update)
    else:
        hf_names = [n for n in baseline_names if n not in (vllm_runs.VLLM, llamacpp_runs.LLAMACPP)]
        each_round = []
        for number in range(1, args.rounds + 1):
            one = [engine_runs.run_offline(spec, workload.prompts, args.max_tokens, bar.update)]
            if hf_names:
                # NOTE: a model of its own each round: generate_batch switches the model's attention to its
                # paged variant, so it runs last.
                hf_model = baselines.load_hf_model(model_dir, weight_dtype, device)
                baselines.warm_up(hf_model, pad_token_id)
                for name in sorted(hf_names, key=lambda n: n == "continuous"):
                    bar.set_postfix_str(name)
                    one.append(
                        baselines.run_baseline(
                            name, hf_model, workload.prompts, args.max_tokens, pad_token_id,
                            args.baseline_requests, bar.update,
                        )
                    )
            if vllm_python is not None:
                bar.set_postfix_str("vllm (start-up takes minutes)")
                vllm_result = vllm_runs.run_vllm(
                    vllm_python, args.vllm_model or model_dir, workload.prompts, args.max_tokens,
                    args.vllm_dtype or dtype_name,
                    engine_fields,
                )
                one.append(vllm_result)
                bar.update(vllm_result.num_new_tokens)
            if llamacpp is not None:
                bar.set_postfix_str(f"llama-server, {args.llamacpp_slots} slots")
                one.append(
                    llamacpp_runs.run_llama_server(
                        llamacpp, gguf, workload.prompts, args.max_tokens, args.llamacpp_slots, threads, bar.update
                    )
                )
            each_round.append(one)
            bar.set_postfix_str(f"round {number} of {args.rounds} done")
        results = [median_round([one[i] for one in each_round]) for i in range(len(each_round[0]))]
        sections["rounds"] = round_rates(each_round) if args.rounds > 1 else None
    if args.profile:
        bar.set_postfix_str("profile")
        sections["profile"] = profiling.profile_steps(
            spec, workload.prompts[: min(len(workload.prompts), 64)], args.max_tokens,
            args.profile_dir,
        )
    ceiling = None
    if not args.no_ceiling and args.workload != BATCH1:  # batch 1's bound is memory's, in its section
        bar.set_postfix_str("matmul ceiling")
        # NOTE: the engine's compute dtype: float32 over bfloat16 weights on CPU (its kernels pick the bfloat16 path).
        ceiling = measure_ceiling(model_dir, compute_dtype, weight_dtype)
    bar.close()

    report = build_report(
        results,
        workload={
            "name": workload.name,
            "description": workload.description,
            "num_requests": len(workload.prompts),
            "num_prompt_tokens": workload.num_prompt_tokens,
        },
        machine=machine_info(),
        protocol={
            "model": str(model or "bundled SmolLM2-135M-Instruct"),
            "dtype": dtype_name,
            "engine": engine_fields,
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": args.workload != "structured",
            "submitted": "all at once" if args.workload != "poisson" else f"poisson arrivals from {args.rate} req/s",
            **({"vllm_dtype": args.vllm_dtype or dtype_name} if vllm_python is not None else {}),
        },
        model=describe_model(model, model_dir),
        ceiling=ceiling,
        skipped=skipped,
        **sections,
    )
    print(_render(report, format_table, format_poisson, format_sweep, format_structured, format_profile))  # noqa: T201
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.record:
        append_record(args.record, make_record(report, args.command_line))
        logger.info("recorded in %s; `paged figures` renders the docs' tables from it", args.record)
    if args.plot:
        from integrations.bench.plots import write_plots

        for path in write_plots(args.plot, f"{args.workload}-{dtype_name}", results, report):
            logger.info("wrote %s", path)
    return 0


def _run_embed(args: argparse.Namespace) -> int:
    import torch

    from integrations.bench.embed import embed_bench, format_embed

    baselines = args.baselines if args.compare else []
    if any(b not in ("sentence-transformers", vllm_runs.VLLM, llamacpp_runs.LLAMACPP) for b in baselines):
        raise FlagError(
            "--workload embed compares the engine with sentence-transformers, vLLM and llama.cpp: "
            "--baselines sentence-transformers,vllm,llamacpp"
        )
    # a missing vLLM environment or llama.cpp build is a usage error before any run
    vllm_python = vllm_runs.vllm_python(args.vllm_python) if vllm_runs.VLLM in baselines else None
    llamacpp = None
    if llamacpp_runs.LLAMACPP in baselines:
        llamacpp = llamacpp_runs.find_llamacpp(args.llamacpp_dir, tools=(llamacpp_runs.SERVER_TOOL,))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fields = engine_kwargs(args)
    model = fields.pop("model")
    if model is None:
        raise FlagError("--workload embed needs an embedding model: --model DIR")
    report = embed_bench(
        str(model), fields, args.num_requests, args.chunk_tokens, args.batch_size, baselines, args.rounds, args.queries,
        vllm_python=vllm_python, llamacpp=llamacpp,
    )
    report["machine"] = machine_info()
    print(format_embed(report))  # noqa: T201
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _render(report: dict[str, Any], table: Any, poisson: Any, sweep: Any, structured: Any, profile: Any) -> str:
    w = report["workload"]
    p = report["protocol"]
    parts = [
        f"\n{w['description']}, {p['dtype']}\n"
        if w["name"] == BATCH1
        else f"\n{w['description']}: {w['num_requests']} requests, {w['num_prompt_tokens']} prompt tokens, "
        f"{'' if p['ignore_eos'] else 'at most '}{p['max_tokens']} new tokens each, {p['dtype']}\n"
    ]
    if report["results"] or report["ceiling"]:
        parts.append(table(report))
    if report["poisson"]:
        parts.append("\n" + poisson(report["poisson"]))
    if report["sweep"]:
        parts.append("\n" + sweep(report["sweep"]))
    if report["structured"]:
        parts.append("\n" + structured(report["structured"]))
    if report["profile"]:
        parts.append("\n" + profile(report["profile"]))
    if report["batch1"]:
        from integrations.bench.batch1 import format_batch1

        parts.append("\n" + format_batch1(report["batch1"]))
    parts += [f"- {name} skipped: {reason}" for name, reason in report["skipped"].items()]
    return "\n".join(parts)


def _expected_tokens(args: argparse.Namespace, workload: Any, baseline_names: list[str]) -> int | None:
    if args.workload in ("poisson", "sweep", "structured", BATCH1):
        return None
    total = len(workload.prompts) * args.max_tokens
    for name in baseline_names:
        count = len(workload.prompts)
        if name == "one-by-one" and args.baseline_requests is not None:
            count = min(count, args.baseline_requests)
        total += count * args.max_tokens
    return total * args.rounds
