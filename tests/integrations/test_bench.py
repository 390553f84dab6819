"""``paged bench``: workloads, baselines, ceiling and the JSON report, on a tiny random-weight model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from integrations.bench.ceiling import linear_shapes
from integrations.bench.engine_runs import saturation_point
from integrations.bench.report import ENGINE, RunResult, agreement, percentile
from integrations.bench.workloads import build_workload, rag_turns
from integrations.cli import main

RESULT_FIELDS = {
    "name", "tokens_per_s", "ratio_to_engine", "wall_s", "num_requests", "num_new_tokens",
    "num_prompt_tokens", "prompt_tokens_computed", "prefix_cache_hit_rate", "num_preemptions",
    "ttft_s", "itl_s", "matches_engine", "notes",
}


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def tokenizer(bundled_model_dir: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(bundled_model_dir)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_compare_run_writes_documented_json(tiny_dir: Path, tmp_path: Path) -> None:
    """A --compare run yields every contender with the documented fields, exact token counts and plots."""
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_dir), "--num-blocks", "256", "--num-requests", "3", "--max-tokens", "3", "--compare",
        "--baselines", "one-by-one,static-2,continuous", "--baseline-requests", "2",
        "--json", str(out), "--plot", str(tmp_path / "plots"), "--no-progress",
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report) >= {"schema", "workload", "machine", "protocol", "results", "ceiling"}
    assert report["protocol"]["max_tokens"] == 3 and report["workload"]["num_requests"] == 3
    by_name = {r["name"]: r for r in report["results"]}
    assert list(by_name) == [
        ENGINE, "HF generate, one by one", "HF generate, static batches of 2", "transformers continuous batching",
    ]
    for r in report["results"]:
        assert set(r) >= RESULT_FIELDS
        assert r["tokens_per_s"] > 0 and r["ttft_s"]["count"] == r["num_requests"]
        assert r["num_new_tokens"] == 3 * r["num_requests"]  # EOS ignored: exactly max_tokens each
    engine = by_name[ENGINE]
    assert engine["ratio_to_engine"] == pytest.approx(1.0)
    assert engine["num_requests"] == 3 and by_name["HF generate, one by one"]["num_requests"] == 2
    # The shared system prompt is computed once: later requests hit the prefix cache.
    assert engine["prompt_tokens_computed"] < engine["num_prompt_tokens"]
    assert 0 < engine["prefix_cache_hit_rate"] < 1
    # Greedy float32 decoding of the same prompts gives the engine's tokens.
    assert by_name["HF generate, one by one"]["matches_engine"] == 1.0
    ceiling = report["ceiling"]
    assert ceiling["tokens_per_s"] > 0 and ceiling["engine_fraction"] > 0
    # --dtype auto is what the engine makes of it: float32 on CPU, for the baselines and the ceiling too.
    assert ceiling["dtype"] == ceiling["weight_dtype"] == report["protocol"]["dtype"] == "float32"
    assert report["protocol"]["engine"]["dtype"] == "auto" and report["protocol"]["engine"]["num_blocks"] == 256
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["shared-prefix-float32-latency.png", "shared-prefix-float32-throughput.png"]


def test_engine_runs_get_every_engine_flag(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine flag reaches the engine the bench builds, not only --dtype and --num-blocks."""
    from integrations.bench import engine_runs

    class Stop(Exception):
        pass

    seen = {}

    def fake_run_offline(spec, prompts, max_tokens, progress):
        seen.update(spec.settings, model=spec.model)
        raise Stop

    monkeypatch.setattr(engine_runs, "run_offline", fake_run_offline)
    flags = ["--block-size", "8", "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching", "--max-num-seqs", "4",
             "--attention-backend", "torch", "--max-queued-requests", "7", "--seed", "3"]  # fmt: skip
    with pytest.raises(Stop):
        main(["bench", "--model", str(tiny_dir), "--num-requests", "2", "--no-ceiling", "--no-progress", *flags])
    expected = EngineConfig(model=str(tiny_dir), block_size=8, kv_cache_memory=64 << 20, enable_prefix_caching=False,
                            max_num_seqs=4, attention_backend="torch", max_queued_requests=7, seed=3)  # fmt: skip
    assert seen == {f.name: getattr(expected, f.name) for f in dataclasses.fields(EngineConfig)}


def test_profile_splits_step_time_and_writes_trace(tiny_dir: Path, tmp_path: Path) -> None:
    """--profile reports every step phase, sums to at most the step time, and leaves a trace file."""
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_dir), "--num-blocks", "256", "--workload", "distinct", "--num-requests", "2", "--max-tokens", "3",
        "--profile", "--profile-dir", str(tmp_path / "prof"), "--no-ceiling", "--json", str(out), "--no-progress",
    ])
    assert rc == 0
    profile = json.loads(out.read_text())["profile"]
    assert set(profile["phases_s"]) == {
        "schedule", "prepare inputs", "forward", "sample", "update", "detokenize", "emit outputs", "hooks", "other",
    }
    assert profile["phases_s"]["forward"] > 0 and profile["num_steps"] >= 3
    assert sum(profile["phases_s"].values()) == pytest.approx(profile["step_s"], rel=1e-6)
    trace = Path(profile["trace"])
    assert trace.parent == tmp_path / "prof" and "traceEvents" in json.loads(trace.read_text())


def test_structured_workload_reports_mask_cost_and_validity(tiny_dir: Path, tmp_path: Path) -> None:
    """--workload structured decodes the same prompts with and without the schema, in one run, all replies valid."""
    from integrations.bench.structured import CONSTRAINED, MASK_PHASES

    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_dir), "--num-blocks", "256", "--workload", "structured", "--num-requests", "4",
        "--max-tokens", "256", "--no-ceiling", "--json", str(out), "--no-progress",
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    plain, constrained = report["results"]
    assert (plain["name"], constrained["name"]) == (ENGINE, CONSTRAINED)
    assert plain["num_new_tokens"] == constrained["num_new_tokens"]  # each prompt decodes its twin's length
    structured = report["structured"]
    assert set(structured) == {
        "schema", "num_requests", "tokens_per_s", "ratio", "num_steps", "step_ms", "mask_ms_per_step",
        "mask_share_of_step", "mask_share_from_ratio", "valid_fraction", "output_tokens",
    }
    assert structured["valid_fraction"] == 1.0 and structured["num_requests"] == 4
    assert set(report["machine"]["cpu_flags"]) <= {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx"}
    assert structured["output_tokens"]["max"] < 256
    assert structured["ratio"] == pytest.approx(constrained["ratio_to_engine"])
    assert structured["tokens_per_s"]["unconstrained"] == pytest.approx(plain["tokens_per_s"])
    assert set(structured["mask_ms_per_step"]) == set(MASK_PHASES)
    assert all(ms > 0 for ms in structured["mask_ms_per_step"].values())
    assert 0 < structured["mask_share_of_step"] < 1


def test_sweep_reports_each_concurrency(tiny_dir: Path, tmp_path: Path) -> None:
    """The sweep measures each requested concurrency level, in order."""
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_dir), "--num-blocks", "256", "--workload", "sweep", "--concurrency", "2,1", "--max-tokens", "2",
        "--no-ceiling", "--json", str(out), "--no-progress",
    ])
    assert rc == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert [row["concurrency"] for row in sweep["levels"]] == [1, 2]
    assert all(row["tokens_per_s"][ENGINE] > 0 for row in sweep["levels"])


def test_poisson_search_reports_rates(tiny_dir: Path, tmp_path: Path) -> None:
    """Poisson arrivals through AsyncEngine: one run per trial, the best rate is one that met the bound."""
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_dir), "--num-blocks", "256", "--workload", "poisson", "--num-requests", "3", "--max-tokens", "3",
        "--rate", "50", "--rate-trials", "2", "--itl-bound", "100", "--no-ceiling", "--json", str(out),
        "--no-progress",
    ])
    assert rc == 0
    poisson = json.loads(out.read_text())["poisson"]
    assert [run["rate"] for run in poisson["runs"]] == [50, 100]  # within a 100 s bound: the rate doubles
    assert all(run["within_bound"] and run["ttft_s"]["count"] == 3 for run in poisson["runs"])
    assert poisson["max_rate_within_bound"] == 100


def test_poisson_table_alone_without_contender_results() -> None:
    """A Poisson run has no contender rows: the printed report has no empty contender table, only the ceiling."""
    from integrations.bench.report import format_table

    ceiling = {"dtype": "float32", "batch": 64, "gflops": 120.0, "tokens_per_s": 450.0}
    assert format_table({"results": [], "ceiling": ceiling}) == (
        "- machine ceiling (float32, matmuls at batch 64): 120 GFLOP/s = 450 tok/s"
    )
    widened = ceiling | {"weight_dtype": "bfloat16"}  # bfloat16 on a CPU without bfloat16 arithmetic
    assert format_table({"results": [], "ceiling": widened}) == (
        "- machine ceiling (bfloat16 weights computed in float32, matmuls at batch 64): 120 GFLOP/s = 450 tok/s"
    )


def test_linear_shapes_count_every_matmul_weight(tiny_model_factory) -> None:
    """The ceiling's FLOPs per token come from exactly the model's nn.Linear weights."""
    import transformers

    for arch in ("llama", "qwen3"):
        model_dir = tiny_model_factory(arch)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        config = json.loads((model_dir / "config.json").read_text())
        assert sum(i * o * n for (i, o), n in linear_shapes(config).items()) == linear_params


def test_shared_prefix_and_distinct_workloads(tokenizer) -> None:
    """W1 prompts share the ~290-token system prompt; W2 prompts share no more than the template header."""
    shared = build_workload("shared-prefix", tokenizer, 64).prompts
    distinct = build_workload("distinct", tokenizer, 64).prompts
    assert len(shared) == len(distinct) == 64
    assert min(_common_prefix(shared[0], p) for p in shared[1:]) > 250
    assert max(_common_prefix(distinct[0], p) for p in distinct[1:]) < 20
    assert build_workload("sweep", tokenizer, 70).prompts[64:] == shared[:6]  # cycles past the file


def test_rag_workload_is_deterministic_and_groups_documents(tokenizer) -> None:
    """RAG prompts are identical across builds; requests over one document share its long prefix."""
    assert rag_turns(8) == rag_turns(8)
    prompts = build_workload("rag", tokenizer, 8).prompts
    assert prompts == build_workload("rag", tokenizer, 8).prompts
    assert _common_prefix(prompts[0], prompts[4]) > 400  # same document (round-robin over 4)
    assert _common_prefix(prompts[0], prompts[1]) < 30  # different documents


def test_extraction_prompts_are_deterministic_and_distinct() -> None:
    """The structured workload's prompts are the same on every build, all distinct, and a longer set extends a shorter."""
    from integrations.bench.extraction import extraction_prompts

    prompts = extraction_prompts(100)
    assert prompts == extraction_prompts(100) and len(set(prompts)) == 100
    assert extraction_prompts(12) == prompts[:12]


def test_percentile_matches_numpy() -> None:
    """Latency percentiles interpolate linearly, as numpy does."""
    rng = np.random.default_rng(0)
    values = list(rng.exponential(size=37))
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None


def test_agreement_counts_same_requests_and_common_prefixes() -> None:
    """Identical requests, and tokens equal from the first, over the prompts both ran."""
    engine = RunResult(ENGINE, 3, 9, 1.0, 9, output_token_ids=[[1, 2, 3], [4, 5, 6], [7, 8, 9]], prompt_indices=[0, 1, 2])
    other = RunResult("other", 2, 6, 1.0, 6, output_token_ids=[[4, 5, 0], [7, 8, 9]], prompt_indices=[1, 2])
    assert agreement(other, engine) == (1, 2, 2.5)
    assert agreement(engine, engine) is None and agreement(other, None) is None


def test_saturation_point() -> None:
    """The knee is the first level after which doubling gains less than 10%."""
    rows = [{"concurrency": c, "tokens_per_s": {ENGINE: t}} for c, t in [(1, 10), (2, 19), (4, 30), (8, 31), (16, 40)]]
    assert saturation_point(rows) == 4
    assert saturation_point(rows[:3]) is None


def test_bad_arguments_are_rejected(tiny_dir: Path) -> None:
    """Non-positive sizes, unknown workloads and unknown baselines stop at argument parsing."""
    for argv in (["--num-requests", "0"], ["--workload", "nope"], ["--concurrency", "1,x"], ["--baselines", "sglang"]):
        with pytest.raises(SystemExit):
            main(["bench", "--model", str(tiny_dir), "--num-blocks", "256", *argv])

