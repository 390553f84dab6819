"""kv_cache_dir: pinned prefixes survive close() and a restart, damaged or foreign files never serve wrong KV."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from engine import AsyncEngine, Engine, EngineConfig, EngineError, SamplingParams
from engine.errors import ParameterError
from engine.supervisor import RestartPolicy
from sdk.runtime import Runtime
from tests.support.faults import inject_fault

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(300, 300 + 41))  # 10 full blocks of 4 and one token
QUESTIONS = [SYSTEM + [900 + i, 910 + i, 920 + i] for i in range(3)]
CONFIG = dict(num_blocks=64, block_size=4, dtype="float32", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def reference(model_dir: str) -> list[list[int]]:
    """The greedy tokens of QUESTIONS from an engine that persists nothing."""
    engine = Engine(model_dir, **CONFIG)
    return [o.outputs[0].token_ids for o in engine.generate(QUESTIONS, GREEDY, use_tqdm=False)]


def pinned_and_closed(model_dir: str, directory: Path, cache_salt: str | None = None, **config: object) -> None:
    """An engine that pins SYSTEM, answers one question and closes, saving to ``directory``."""
    with Engine(model_dir, **{**CONFIG, **config}, kv_cache_dir=directory, kv_cache_save_hot_blocks=0) as engine:
        engine.pin_prefix(SYSTEM, cache_salt)
        while engine.has_unfinished_requests():
            engine.step()


def answer(engine: Engine, prompts: list[list[int]], cache_salt: str | None = None) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and num_cached_tokens of each prompt, one at a time."""
    tokens, cached = [], []
    for prompt in prompts:
        request_id = engine.add_request(None, prompt, GREEDY, cache_salt=cache_salt)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished and output.request_id == request_id:
                    tokens.append(output.outputs[0].token_ids)
                    cached.append(output.num_cached_tokens)
    return tokens, cached


def assert_pool_whole(engine: Engine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished_requests()


def test_a_new_engine_computes_only_the_new_tokens_of_a_persisted_system_prompt(model_dir, reference, tmp_path, caplog) -> None:
    pinned_and_closed(model_dir, tmp_path)
    assert len(list(tmp_path.rglob("*.kvb"))) == 10  # the pin's full blocks only (no hot blocks asked)
    with caplog.at_level(logging.INFO, logger="engine.core.kv_cache_manager"):
        engine = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path)
    (line,) = [r for r in caplog.records if "kv_cache_dir" in r.getMessage()]
    assert "loaded 10 blocks" in line.getMessage() and "skipped 0" in line.getMessage()
    tokens, cached = answer(engine, QUESTIONS)
    assert tokens == reference
    assert cached == [40, 40, 40]
    stats = engine.stats()
    assert stats["prompt_tokens_computed"] == 3 * (len(QUESTIONS[0]) - 40)
    assert_pool_whole(engine)


def test_the_bundled_model_answers_the_same_from_a_persisted_prompt(tmp_path) -> None:
    """The real model: a system prompt pinned and saved on close; the next engine hits it and says the same."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    system = "You are a helpful assistant who answers questions about geography in one short sentence.\n" * 4
    prompts = [system + "What is the capital of France?", system + "What is the capital of Italy?"]
    config = dict(num_blocks=128, block_size=16)
    with Engine(**config, kv_cache_dir=tmp_path) as first:
        first.pin_prefix(system)
        while first.has_unfinished_requests():
            first.step()
        expected = [o.outputs[0].text for o in first.generate(prompts, params, use_tqdm=False)]
    assert "Paris" in expected[0]
    second = Engine(**config, kv_cache_dir=tmp_path)
    outputs = [second.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].text for o in outputs] == expected
    pinned = second.tokenize(system)
    for output in outputs:  # every full block of the system prompt the question's tokens still start with
        ids = output.prompt_token_ids
        common = next(i for i, (a, b) in enumerate(zip(pinned + [-1], ids)) if a != b)
        assert common >= 48 and output.num_cached_tokens == 16 * (common // 16)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_files_are_ignored_with_one_log_line_and_answers_stay_right(
    model_dir, reference, tmp_path, caplog, damage
) -> None:
    pinned_and_closed(model_dir, tmp_path)
    files = sorted(tmp_path.rglob("*.kvb"))
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if damage == "flip":  # a byte of every file's K/V payload, each at another offset
            data[len(data) // 3 + 97 * i] ^= 0x40
        path.write_bytes(bytes(data[: len(data) // 2]) if damage == "truncate" else b"" if damage == "empty" else bytes(data))
    with caplog.at_level(logging.INFO, logger="engine.core.kv_cache_manager"):
        engine = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path)
    (line,) = [r for r in caplog.records if "kv_cache_dir" in r.getMessage()]
    reason = "torn or not a block file" if damage == "empty" else "checksum mismatch"
    assert line.levelno == logging.WARNING and f"loaded 0 blocks" in line.getMessage()
    assert f"skipped 10 (10 {reason})" in line.getMessage()
    tokens, cached = answer(engine, QUESTIONS)
    assert tokens == reference and cached == [0, 40, 40]  # the first recomputes, the others share its blocks
    assert_pool_whole(engine)


def test_one_damaged_block_drops_only_its_chain_from_it_on(model_dir, reference, tmp_path) -> None:
    """The 6th block of the pinned prompt is damaged: the 5 before it still load, the 5 after it do not."""
    pinned_and_closed(model_dir, tmp_path)
    sixth = f"[{', '.join(map(str, SYSTEM[20:24]))}]".encode()  # its token ids, as its header lists them
    victim = next(p for p in tmp_path.rglob("*.kvb") if sixth in p.read_bytes())
    data = bytearray(victim.read_bytes())
    data[-40] ^= 0x01
    victim.write_bytes(bytes(data))
    engine = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path)
    assert answer(engine, QUESTIONS[:1]) == (reference[:1], [20])


@pytest.mark.parametrize("other", [dict(block_size=8), dict(dtype="bfloat16"), dict(enforce_eager=True)])
def test_blocks_of_another_layout_are_ignored(model_dir, reference, tmp_path, caplog, other) -> None:
    """Another block size or dtype is another layout: nothing loads; enforce_eager changes no layout: all load."""
    pinned_and_closed(model_dir, tmp_path)
    with caplog.at_level(logging.INFO, logger="engine.core.kv_cache_manager"):
        engine = Engine(model_dir, **{**CONFIG, **other}, kv_cache_dir=tmp_path)
    (line,) = [r.getMessage() for r in caplog.records if "kv_cache_dir" in r.getMessage()]
    if "enforce_eager" in other:
        assert "loaded 10 blocks" in line
        return
    assert "loaded 0 blocks" in line and "skipped 10 (10 another layout)" in line
    if other.get("block_size") == 8:
        tokens, cached = answer(engine, QUESTIONS)
        assert tokens == reference and cached == [0, 40, 40]


def test_files_of_the_previous_format_are_skipped_quietly_and_replaced_on_close(
    model_dir, reference, tmp_path, caplog
) -> None:
    """Format-1 files (before image keys) are no damage: skipped at INFO; the engine's close writes format 2."""
    from engine.core.kv_persistence import MAGIC

    pinned_and_closed(model_dir, tmp_path)
    for path in tmp_path.rglob("*.kvb"):
        path.write_bytes(b"PAGEDKV\x01" + path.read_bytes()[len(MAGIC) :])
    with caplog.at_level(logging.INFO, logger="engine.core.kv_cache_manager"):
        engine = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path)
    (line,) = [r for r in caplog.records if "kv_cache_dir" in r.getMessage()]
    assert line.levelno == logging.INFO and "skipped 10 (10 another format version)" in line.getMessage()
    assert answer(engine, QUESTIONS[:1]) == (reference[:1], [0])
    engine.close()
    assert {p.read_bytes()[: len(MAGIC)] for p in tmp_path.rglob("*.kvb")} == {MAGIC}
    assert answer(Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path), QUESTIONS[:1]) == (reference[:1], [40])


def test_salted_blocks_are_restored_under_their_salt_only(model_dir, reference, tmp_path) -> None:
    pinned_and_closed(model_dir, tmp_path, cache_salt="tenant-a")
    assert {p.parent.name for p in tmp_path.rglob("*.kvb")} != {"shared"}
    engine = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path)
    assert answer(engine, QUESTIONS[:1], cache_salt="tenant-b") == (reference[:1], [0])
    assert answer(engine, QUESTIONS[1:2]) == (reference[1:2], [0])
    assert answer(engine, QUESTIONS[2:], cache_salt="tenant-a") == (reference[2:], [40])
    assert_pool_whole(engine)


def test_hot_blocks_and_interval_saves(model_dir, reference, tmp_path) -> None:
    """Without a pin, the most recently used blocks are saved, every interval between steps and on close."""
    engine = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path, kv_cache_save_interval_s=1e-6,
                    kv_cache_save_hot_blocks=12)  # fmt: skip
    answer(engine, QUESTIONS[:1])
    assert len(list(tmp_path.rglob("*.kvb"))) > 0  # saved by a step, before close
    engine.close()
    assert len(list(tmp_path.rglob("*.kvb"))) == 12  # the question's full blocks: 44 prompt + 7 computed tokens
    again = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path)
    assert answer(again, QUESTIONS[1:]) == (reference[1:], [40, 40])


def test_close_is_idempotent_and_a_closed_engine_takes_no_request(model_dir, tmp_path) -> None:
    engine = Engine(model_dir, **CONFIG, kv_cache_dir=tmp_path)
    engine.add_request("unfinished", QUESTIONS[0], GREEDY)
    engine.step()
    engine.close()
    engine.close()
    assert_pool_whole(engine)
    with pytest.raises(EngineError, match="closed"):
        engine.add_request(None, QUESTIONS[0], GREEDY)
    with pytest.raises(EngineError, match="kv_cache_dir"):
        Engine(model_dir, **CONFIG).save_kv_cache()


def test_settings_are_checked_naming_the_field(model_dir, tmp_path) -> None:
    for bad, field in (
        (dict(kv_cache_dir=tmp_path, enable_prefix_caching=False), "kv_cache_dir"),
        (dict(kv_cache_save_interval_s=5.0), "kv_cache_save_interval_s"),
        (dict(kv_cache_dir=tmp_path, kv_cache_save_interval_s=0.0), "kv_cache_save_interval_s"),
        (dict(kv_cache_dir=tmp_path, kv_cache_save_hot_blocks=-1), "kv_cache_save_hot_blocks"),
        (dict(kv_cache_dir=3), "kv_cache_dir"),
    ):
        with pytest.raises(ParameterError) as err:
            EngineConfig(**bad)
        assert err.value.param == field
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ParameterError) as err:
        Engine(model_dir, **CONFIG, kv_cache_dir=not_a_dir)
    assert err.value.param == "kv_cache_dir"


async def test_async_engine_and_runtime_save_on_close(model_dir, reference, tmp_path) -> None:
    first = tmp_path / "async"
    engine = AsyncEngine(model_dir, **CONFIG, kv_cache_dir=first, kv_cache_save_hot_blocks=0)
    await engine.pin_prefix(SYSTEM)
    await engine.aclose()
    assert len(list(first.rglob("*.kvb"))) == 10
    second = tmp_path / "runtime"
    runtime = Runtime(model_dir, **CONFIG, kv_cache_dir=second, kv_cache_save_hot_blocks=0)
    await runtime.start()
    await runtime.engine.pin_prefix(SYSTEM)
    await asyncio.to_thread(runtime.close)
    assert len(list(second.rglob("*.kvb"))) == 10
    third = AsyncEngine(model_dir, **CONFIG, kv_cache_dir=second)
    outputs = [o async for o in third.generate(QUESTIONS[0], GREEDY)]
    assert outputs[-1].outputs[0].token_ids == reference[0] and outputs[-1].num_cached_tokens == 40
    await asyncio.to_thread(third.close)


async def test_a_restarted_engine_reloads_the_directory(model_dir, reference, tmp_path) -> None:
    """After a forced driver death, the fresh engine loads what was saved: the pinned prompt is a hit."""
    engine = AsyncEngine(model_dir, **CONFIG, kv_cache_dir=tmp_path, restart=RestartPolicy(backoff_s=0.01, resume=False))
    try:
        await engine.pin_prefix(SYSTEM)
        await engine.call(lambda e: e.save_kv_cache())
        with inject_fault(engine, "schedule"):
            with pytest.raises(EngineError):
                async for _ in engine.generate(QUESTIONS[1], GREEDY):
                    pass
        while engine.health().status != "running":
            await asyncio.sleep(0.02)
        assert engine.health().restarts == 1
        outputs = [o async for o in engine.generate(QUESTIONS[0], GREEDY)]
        assert outputs[-1].outputs[0].token_ids == reference[0] and outputs[-1].num_cached_tokens == 40
        assert await engine.call(lambda e: e.kv.stats().num_used_blocks) == 0
    finally:
        await engine.aclose()


def test_paged_serve_takes_the_settings_as_flags(tmp_path) -> None:
    """`paged serve --kv-cache-dir DIR ...` sets the fields; a refused combination names the flags."""
    import argparse

    from integrations.engine_flags import FlagError, engine_config
    from integrations.openai_server.command import add_arguments

    parser = argparse.ArgumentParser(prog="paged serve")
    add_arguments(parser)
    argv = ["--kv-cache-dir", str(tmp_path), "--kv-cache-save-interval-s", "30", "--kv-cache-save-hot-blocks", "8"]
    config = engine_config(parser.parse_args(argv))
    assert (config.kv_cache_dir, config.kv_cache_save_interval_s, config.kv_cache_save_hot_blocks) == (str(tmp_path), 30.0, 8)
    with pytest.raises(FlagError, match="--kv-cache-save-interval-s needs --kv-cache-dir"):
        engine_config(parser.parse_args(["--kv-cache-save-interval-s", "30"]))


def test_sliding_window_model_keeps_nothing_on_disk(tiny_model_factory, tmp_path: Path, caplog) -> None:
    """A sliding-window model's blocks hold one KV cache group's layers: nothing is saved, with one warning."""
    with caplog.at_level(logging.WARNING, logger="engine.llm_engine"):
        with Engine(str(tiny_model_factory("mistral_sliding")), **CONFIG, kv_cache_dir=tmp_path) as engine:
            assert engine.persisted_kv is None
            engine.generate([list(range(1, 40))], SamplingParams(max_tokens=2, temperature=0.0))
    assert [r.message for r in caplog.records if "kv_cache_dir" in r.message and "sliding" in r.message]
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
