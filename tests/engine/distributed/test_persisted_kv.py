"""kv_cache_dir under tensor and pipeline parallelism (gloo ranks on CPU, a tiny random Llama in float32): every
rank's KV heads or layers are saved and loaded, one file per block holding every rank's part; a second engine of
the same split serves the saved prefix and gives the first engine's greedy tokens; another split skips the
directory as another layout; a block a rank did not take is not restored on any."""

from __future__ import annotations

import json
import logging

import pytest

import engine.distributed.runner as parallel_runner
import engine.persisted_kv as persisted_kv
from engine import Engine
from engine.core.kv_layout import split_payload
from engine.errors import KVTransferFailed
from tests.engine.test_kv_cache_dir import CONFIG, QUESTIONS, SYSTEM, answer, assert_pool_whole

SPLITS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}
NUM_SYSTEM_BLOCKS = len(SYSTEM) // CONFIG["block_size"]  # 10


def load_line(caplog) -> logging.LogRecord:
    (line,) = [r for r in caplog.records if "kv_cache_dir" in r.getMessage() and "loaded" in r.getMessage()]
    return line


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_second_engine_of_the_split_serves_the_saved_prefix(split, model_dir, tmp_path, caplog, monkeypatch) -> None:
    """The first engine pins SYSTEM, answers QUESTIONS (computing them) and saves on close; the second, on the
    same directory, loads the 10 blocks, computes only each question's own tokens and gives the same tokens,
    every block back in the pool after; one process skips the split's directory as another layout. Blocks move
    3 at a time, so that saves and loads span several calls on the ranks."""
    monkeypatch.setattr(parallel_runner, "_KV_BATCH", 3)
    monkeypatch.setattr(persisted_kv, "_BATCH", 3)
    options = {**CONFIG, **SPLITS[split], "kv_cache_dir": tmp_path, "kv_cache_save_hot_blocks": 0}
    with Engine(model_dir, **options) as first:
        first.pin_prefix(SYSTEM)
        expected, cached = answer(first, QUESTIONS)
        assert cached == [40, 40, 40]  # the pin computed SYSTEM once
    [layout_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    layout = json.loads((layout_dir / "layout.json").read_text())
    assert [(s[0], s[1]) for s in layout["shards"]] == ([(0, 0), (1, 0)] if split == "tp2" else [(0, 0), (0, 1)])
    assert len(list(tmp_path.rglob("*.kvb"))) == NUM_SYSTEM_BLOCKS

    with caplog.at_level(logging.INFO, logger="engine.core.kv_cache_manager"):
        second = Engine(model_dir, **{**options, "kv_cache_save_hot_blocks": 64})
    try:
        line = load_line(caplog).getMessage()
        assert f"loaded {NUM_SYSTEM_BLOCKS} blocks" in line and "skipped 0" in line
        tokens, cached = answer(second, QUESTIONS)
        assert tokens == expected and cached == [40, 40, 40]
        assert second.stats()["prompt_tokens_computed"] == 3 * (len(QUESTIONS[0]) - 40)
        assert_pool_whole(second)
    finally:
        second.close()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.core.kv_cache_manager"):
        one = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path)
    line = load_line(caplog)
    assert line.levelno == logging.INFO
    assert "loaded 0 blocks" in line.getMessage() and "another layout" in line.getMessage()
    assert answer(one, QUESTIONS[:1]) == (expected[:1], [0])
    assert_pool_whole(one)


def test_a_block_one_rank_did_not_take_is_restored_on_none(model_dir, tmp_path, caplog, monkeypatch) -> None:
    """tp=2. A rank gone: a save raises KVTransferFailed and leaves the directory as it was. Rank 1 sent a part
    one byte short of each block: its write fails, the batch is evicted again and the blocks after it are not
    loaded (a WARNING counts them all), the prompt is computed in full with the same tokens, the pool is whole."""
    options = {**CONFIG, **SPLITS["tp2"], "kv_cache_dir": tmp_path, "kv_cache_save_hot_blocks": 0}
    first = Engine(model_dir, **{**options, "kv_cache_save_hot_blocks": 64})
    first.pin_prefix(SYSTEM)
    while first.has_unfinished_requests():
        first.step()
    assert first.save_kv_cache() == NUM_SYSTEM_BLOCKS
    expected, _ = answer(first, QUESTIONS[:1])  # 2 blocks more to save: its question and output
    rank1 = first.runner.workers.processes[0]
    rank1.kill()
    rank1.join()
    with pytest.raises(KVTransferFailed, match="rank is gone"):
        first.save_kv_cache()
    with pytest.raises(KVTransferFailed):
        first.close()
    assert len(list(tmp_path.rglob("*.kvb"))) == NUM_SYSTEM_BLOCKS

    def short_of_a_byte(payload, sizes):
        parts = split_payload(payload, sizes)
        return [*parts[:-1], parts[-1][:-1]]

    monkeypatch.setattr(parallel_runner, "split_payload", short_of_a_byte)
    monkeypatch.setattr(persisted_kv, "_BATCH", 3)
    with caplog.at_level(logging.INFO, logger="engine.core.kv_cache_manager"):
        second = Engine(model_dir, **options)
    try:
        line = load_line(caplog)
        assert line.levelno == logging.WARNING and "loaded 0 blocks" in line.getMessage()
        assert f"skipped {NUM_SYSTEM_BLOCKS} ({NUM_SYSTEM_BLOCKS} not taken by every rank)" in line.getMessage()
        assert second.kv.block_pool.num_cached_blocks == 0
        assert answer(second, QUESTIONS[:1]) == (expected, [0])
        assert_pool_whole(second)
    finally:
        second.close()
