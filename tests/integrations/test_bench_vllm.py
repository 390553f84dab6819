"""``paged bench --baselines vllm`` without vLLM: a stand-in ``vllm`` package behind a stand-in environment's python.

The worker, the subprocess, the JSON both ways, the agreement and the table rows are real;
only vLLM is not. The stand-in echoes each prompt's tokens and records what it was asked.
"""

from __future__ import annotations

import ast
import json
import shlex
import sys
import tempfile
from pathlib import Path

import pytest

from integrations.bench import engine_runs, report, vllm_runs
from integrations.bench.report import ENGINE, RunResult
from integrations.cli import main

FAKE_VLLM = '''
"""A stand-in for vllm: generate() echoes each prompt's tokens; calls are recorded in $FAKE_VLLM_RECORD."""
import json
import os

__version__ = "0.0-fake"


def _record(*event):
    with open(os.environ["FAKE_VLLM_RECORD"], "a") as f:
        f.write(json.dumps(event) + "\\n")


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _RequestOutput:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]
        self.num_cached_tokens = 2


class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("fake vLLM refuses this CPU")
        _record("init", kwargs, os.environ.get("VLLM_CPU_KVCACHE_SPACE"))

    def generate(self, prompts, params, use_tqdm=True):
        _record("generate", [p["prompt_token_ids"] for p in prompts], params.kwargs, use_tqdm)
        n = params.kwargs["max_tokens"]
        return [_RequestOutput((p["prompt_token_ids"] * n)[:n]) for p in prompts]

    def reset_prefix_cache(self):
        _record("reset_prefix_cache")

    def embed(self, texts, use_tqdm=True):
        _record("embed", len(texts), use_tqdm)
        return [_Embedding([float(len(t)), 1.0] + [0.0] * 382) for t in texts]


class _Embedding:
    def __init__(self, vector):
        self.outputs = type("EmbeddingOutput", (), {"embedding": vector})()
'''


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A vLLM environment's python: ours, with the stand-in ``vllm`` on its path."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    site, ours = shlex.quote(str(tmp_path / "site")), shlex.quote(sys.executable)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {ours} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.jsonl"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the runs' working folders
    return python


def _record(tmp_path: Path) -> list[list]:
    return [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]


def test_worker_imports_only_the_standard_library_and_vllm() -> None:
    """The vLLM environment has none of this project's packages nor their dependencies."""
    tree = ast.parse(vllm_runs.WORKER.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    tops = {m.split(".")[0] for m in modules}
    assert "vllm" in tops and tops - {"vllm", "__future__"} <= sys.stdlib_module_names


def test_run_vllm_sends_the_workload_and_parses_the_result(fake_python: Path, tmp_path: Path) -> None:
    """The engine's settings reach LLM(); a warm-up and a cache reset come before the one timed generate."""
    prompts = [[5, 6, 7], [8, 9]]
    engine_kwargs = {"max_model_len": None, "enable_prefix_caching": False, "max_num_seqs": 7,
                     "max_num_batched_tokens": 512, "seed": 3}  # fmt: skip
    result = vllm_runs.run_vllm(fake_python, tmp_path / "model", prompts, 4, "bfloat16", engine_kwargs)
    (_, llm_kwargs, kv_space), warm_up, reset, timed = _record(tmp_path)
    assert llm_kwargs == {"model": str(tmp_path / "model"), "dtype": "bfloat16", "max_model_len": 3 + 4,
                          "max_num_seqs": 7, "max_num_batched_tokens": 512, "enable_prefix_caching": False,
                          "seed": 3}  # fmt: skip
    assert kv_space == vllm_runs.DEFAULT_KV_CACHE_GIB
    assert warm_up[0] == "generate" and warm_up[1] != prompts and reset == ["reset_prefix_cache"]
    greedy = {"max_tokens": 4, "min_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    assert timed == ["generate", prompts, greedy, False]
    assert result.name == "vLLM 0.0-fake" and result.output_token_ids == [[5, 6, 7, 5], [8, 9, 8, 9]]
    assert (result.num_requests, result.num_new_tokens, result.num_prompt_tokens) == (2, 8, 5)
    assert result.prompt_tokens_computed == 5 - 2 * 2 and result.prefix_cache_hit_rate == pytest.approx(4 / 5)
    assert result.startup_s is not None and result.wall_s > 0
    assert not list(tmp_path.glob("paged-bench-vllm-*"))  # the working folder goes once the run succeeds


def test_bench_puts_vllm_in_the_table(
    fake_python: Path, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--baselines static-2,vllm: one table, vLLM's row with its agreement with the engine and its start-up."""
    runs: list[list[RunResult]] = []
    build_report = report.build_report
    monkeypatch.setattr(report, "build_report", lambda rs, **kw: runs.append(rs) or build_report(rs, **kw))
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_dir), "--num-blocks", "256", "--num-requests", "3", "--max-tokens", "3",
        "--compare", "--baselines", "static-2,vllm", "--vllm-python", str(fake_python), "--no-ceiling",
        "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    engine, _, vllm = runs[0]
    rows = json.loads(out.read_text())["results"]
    assert [r["name"] for r in rows] == [ENGINE, "HF generate, static batches of 2", "vLLM 0.0-fake"]
    assert rows[2]["num_new_tokens"] == 9 and rows[2]["startup_s"] >= 0
    # The engine's tokens set against the stand-in's echoes, computed here independently.
    prefixes = [next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), 3)
                for a, b in zip(vllm.output_token_ids, engine.output_token_ids)]  # fmt: skip
    same = sum(a == b for a, b in zip(vllm.output_token_ids, engine.output_token_ids))
    assert rows[2]["matches_engine"] == same / 3 and rows[2]["mean_common_prefix"] == sum(prefixes) / 3
    assert rows[1]["matches_engine"] == 1.0 and rows[1]["mean_common_prefix"] == 3.0  # float32 HF: the same tokens
    assert rows[0]["matches_engine"] is None and rows[0]["mean_common_prefix"] is None
    table = capsys.readouterr().out
    assert f"| vLLM 0.0-fake | {rows[2]['tokens_per_s']:.1f} |" in table and "- vLLM 0.0-fake: CPU build" in table


def test_vllm_dtype_sets_vllms_dtype_alone(fake_python: Path, tiny_dir: Path, tmp_path: Path) -> None:
    """--vllm-dtype float32 with --dtype bfloat16: vLLM is asked for float32, the engine runs bfloat16, and the
    report says each one's dtype."""
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_dir), "--num-blocks", "256", "--num-requests", "2", "--max-tokens", "2",
        "--dtype", "bfloat16", "--compare", "--baselines", "vllm", "--vllm-dtype", "float32",
        "--vllm-python", str(fake_python), "--no-ceiling", "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    (_, llm_kwargs, _), *_ = _record(tmp_path)
    assert llm_kwargs["dtype"] == "float32"
    report = json.loads(out.read_text())
    assert report["protocol"]["dtype"] == "bfloat16"
    assert "offline LLM.generate in float32" in report["results"][1]["notes"]


def test_rounds_take_turns_and_report_each_contenders_median(
    fake_python: Path, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--rounds 3: the engine and vLLM run three times each, taking turns; each row is its contender's median
    round, and every round's rate, with its ratio to the same round's engine rate, follows the table."""
    order: list[str] = []
    for module, name, label in ((engine_runs, "run_offline", "engine"), (vllm_runs, "run_vllm", "vllm")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _l=label, **k: order.append(_l) or _f(*a, **k))
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_dir), "--num-blocks", "256", "--num-requests", "2", "--max-tokens", "3",
        "--rounds", "3", "--compare", "--baselines", "vllm", "--vllm-python", str(fake_python), "--no-ceiling",
        "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    assert order == ["engine", "vllm"] * 3
    assert sum(event[0] == "init" for event in _record(tmp_path)) == 3  # a vLLM process a round
    doc = json.loads(out.read_text())
    rounds = doc["rounds"]
    assert [r["name"] for r in rounds] == [ENGINE, "vLLM 0.0-fake"]
    for row, each in zip(doc["results"], rounds):
        assert len(each["tokens_per_s"]) == 3 and row["tokens_per_s"] == sorted(each["tokens_per_s"])[1]
    engine_rates, vllm_rates = rounds[0]["tokens_per_s"], rounds[1]["tokens_per_s"]
    assert rounds[1]["ratio_to_engine"] == pytest.approx([v / e for v, e in zip(vllm_rates, engine_rates)])
    table = capsys.readouterr().out
    assert "- vLLM 0.0-fake, each round (the row: its median): " + " / ".join(f"{v:.1f}" for v in vllm_rates) in table


def test_rounds_beyond_the_offline_workloads_are_a_usage_error(tiny_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """--rounds with a workload it does not repeat is refused before anything loads, naming the flag."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", str(tiny_dir), "--workload", "poisson", "--rounds", "2", "--no-progress"])
    assert exit_info.value.code == 2
    assert "--rounds applies to the shared-prefix, distinct, rag workloads" in capsys.readouterr().err


def test_failed_vllm_run_is_one_error_naming_its_log(
    fake_python: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """vLLM's traceback stays in its log; paged prints the error line and the log's path, status 1."""
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", str(tiny_dir), "--num-blocks", "256", "--num-requests", "1", "--max-tokens", "2",
              "--compare", "--baselines", "vllm", "--vllm-python", str(fake_python), "--no-ceiling",
              "--no-progress"])  # fmt: skip
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "paged bench: error: vLLM" in err
    assert "exited with status 1: RuntimeError: fake vLLM refuses this CPU" in err
    log = Path(err.split("its log: ")[1].split()[0])
    assert "Traceback" in log.read_text() and (log.parent / "request.json").is_file()
    assert "Traceback" not in err


def test_missing_vllm_env_is_a_usage_error_naming_the_flag(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before anything loads: the flag, the path tried and the command that creates the environment."""
    missing = tmp_path / "nowhere" / "bin" / "python"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", str(tiny_dir), "--compare", "--baselines", "static-16,vllm",
              "--vllm-python", str(missing)])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--vllm-python" in err and str(missing) in err and vllm_runs.SETUP_COMMAND in err


def test_vllm_python_defaults_to_the_env_var_then_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--vllm-python, else $PAGED_VLLM_PYTHON, else ~/.cache/paged-peers/vllm/bin/python; each must be executable."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(vllm_runs.PYTHON_ENV_VAR, raising=False)
    default = tmp_path / ".cache" / "paged-peers" / "vllm" / "bin" / "python"
    with pytest.raises(vllm_runs.VllmEnvMissing, match="the default"):
        vllm_runs.vllm_python(None)
    default.parent.mkdir(parents=True)
    default.write_text("#!/bin/sh\n")
    with pytest.raises(vllm_runs.VllmEnvMissing, match="--vllm-python"):  # not executable yet
        vllm_runs.vllm_python(None)
    default.chmod(0o755)
    assert vllm_runs.vllm_python(None) == default
    monkeypatch.setenv(vllm_runs.PYTHON_ENV_VAR, str(tmp_path / "other"))
    with pytest.raises(vllm_runs.VllmEnvMissing, match=r"\$PAGED_VLLM_PYTHON"):
        vllm_runs.vllm_python(None)
    assert vllm_runs.vllm_python(default) == default



def test_error_lines_find_the_root_cause_under_vllm_prefixes() -> None:
    """The engine core's exception comes first, the front end's generic one last; log headers are dropped."""
    log = """(EngineCore pid=12) INFO 12-02 00:02:18 [core.py:402] init engine took 197.49 s
(EngineCore pid=12) ERROR 12-02 00:02:19 [core.py:980] Traceback (most recent call last):
(EngineCore pid=12) ERROR 12-02 00:02:19 [core.py:980] ValueError: not enough KV cache for 333 tokens
Process EngineCore:
ValueError: not enough KV cache for 333 tokens
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
    assert vllm_runs.error_lines(log) == [
        "ValueError: not enough KV cache for 333 tokens",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ]


def test_embed_bench_runs_vllm_as_a_pooling_model(
    fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--workload embed --baselines vllm: LLM(runner="pooling") on the model's whole path in the engine's dtype, a
    warm-up, the rounds over every chunk, the queries one text each; vLLM's row with its start-up and its vectors'
    least cosine to ours."""
    from tests.support.minilm import shipped_minilm_dir

    monkeypatch.chdir(shipped_minilm_dir().parent)  # --model given relative, as typed in a shell
    out = tmp_path / "embed.json"
    rc = main([
        "bench", "--workload", "embed", "--model", shipped_minilm_dir().name, "--num-requests", "6",
        "--chunk-tokens", "20", "--rounds", "2", "--queries", "3", "--compare", "--baselines", "vllm",
        "--vllm-python", str(fake_python), "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    (_, llm_kwargs, _), *calls = _record(tmp_path)
    model = str(shipped_minilm_dir().resolve())
    assert llm_kwargs == {"model": model, "dtype": "float32", "runner": "pooling", "seed": 0}
    assert calls == [["embed", 6, False]] * 3 + [["embed", 1, False]] * 3  # warm-up, 2 rounds, 3 queries
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    vllm = rows["vLLM 0.0-fake float32"]
    assert len(vllm["rounds_s"]) == 2 and vllm["startup_s"] >= 0 and -1.0 <= vllm["min_cosine"] <= 1.0
    assert "its own process, after the others" in capsys.readouterr().out
