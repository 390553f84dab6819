"""``paged replay``: audited greedy and seeded requests, run concurrently, replay token for token from their records."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from integrations.cli import main
from sdk import AsyncClient
from sdk.hooks import AuditLog

# 10 greedy and 10 seeded requests of mixed kinds and lengths, and one sampled without a seed.
GREEDY: list[dict[str, Any]] = [
    dict(chat="Hello there", temperature=0.0, max_tokens=3),
    dict(prompt="The capital of France is", temperature=0.0, max_tokens=12),
    dict(chat="Write a long story about a dragon " * 6, temperature=0.0, max_tokens=20),
    dict(prompt="1 2 3 4", temperature=0.0, max_tokens=8, n=2),
    dict(chat="Give me a JSON object", temperature=0.0, max_tokens=10, response_format={"type": "json_object"}),
    dict(prompt="Once upon a time", temperature=0.0, max_tokens=16, repetition_penalty=1.3),
    dict(chat="What is 2 + 2?", temperature=0.0, max_tokens=6, logprobs=2),
    dict(prompt="a b c d e f g h i j k l m n o p", temperature=0.0, max_tokens=24, ignore_eos=True),
    dict(chat="Stop early", temperature=0.0, max_tokens=14, stop=["e"]),
    dict(prompt="Repeat after me:", temperature=0.0, max_tokens=5, min_tokens=3),
]
SEEDED: list[dict[str, Any]] = [
    dict(chat="Tell me a joke", temperature=1.0, seed=1, max_tokens=10),
    dict(prompt="In a galaxy far away", temperature=0.8, top_p=0.9, seed=2, max_tokens=18),
    dict(chat="Describe the sea " * 8, temperature=1.2, top_k=40, seed=3, max_tokens=7),
    dict(prompt="Numbers:", temperature=1.0, seed=4, max_tokens=12, n=3),
    dict(chat="Pick a colour", temperature=0.7, min_p=0.05, seed=5, max_tokens=9),
    dict(prompt="Dear diary,", temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, seed=6, max_tokens=15),
    dict(chat="Yes or no?", temperature=1.0, seed=7, max_tokens=6, response_format={"type": "choice", "choice": ["yes", "no"]}),
    dict(prompt="The weather today", temperature=1.5, top_p=0.5, top_k=100, seed=8, max_tokens=20, ignore_eos=True),
    dict(chat="Name three fruits", temperature=0.9, seed=9, max_tokens=4, stop=["a"]),
    dict(prompt="Roses are red", temperature=1.0, seed=2**40, max_tokens=11, logprobs=1),
]
UNSEEDED = dict(prompt="Random words", temperature=1.0, max_tokens=5)


def _run(client: AsyncClient, index: int, spec: dict[str, Any]) -> Any:
    options = dict(spec, request_id=f"req-{index:02d}")
    if "chat" in options:
        return client.chat(options.pop("chat"), **options)
    return client.complete(options.pop("prompt"), **options)


@pytest.fixture(scope="module")
def logs(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    """(inline log, digest log): both hooks audit the same 21 requests, run concurrently on one tiny engine."""
    folder = tmp_path_factory.mktemp("replay")
    inline, digest = AuditLog(folder / "inline.jsonl", replay="inline"), AuditLog(folder / "digest.jsonl", replay="digest")

    async def serve() -> None:
        async with AsyncClient(str(tiny_model_factory("llama")), hooks=[inline, digest]) as client:
            specs = [*GREEDY, *SEEDED, UNSEEDED]
            await asyncio.gather(*(_run(client, i, spec) for i, spec in enumerate(specs)))
            assert client.stats()["hook_failures"] == 0

    asyncio.run(serve())
    inline.close()
    digest.close()
    return inline.path, digest.path


def _replay(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, str]]:
    """Exit status and, per request id, what ``paged replay`` printed about it."""
    status = main(["replay", *argv])
    lines = capsys.readouterr().out.splitlines()
    return status, dict(line.split(": ", 1) for line in lines[:-1])


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_all_greedy_and_seeded_requests_replay_identical(logs, capsys) -> None:
    """All 20 greedy and seeded requests give identical tokens again; the unseeded one is reported, not failed."""
    inline, _ = logs
    status, verdicts = _replay(capsys, str(inline), "--all")
    assert status == 0
    assert [v for k, v in sorted(verdicts.items()) if k != "req-20"] == ["identical"] * 20
    assert verdicts["req-20"].startswith("not replayable: sampled (temperature=1.0) without a seed")
    by_id = {r["request_id"]: r["replay"] for r in _records(inline)}
    assert all(ids for part in by_id.values() for ids in part["completion_token_ids"])
    # n=3 seeded: three different draws (seeds 4, 5, 6), each reproduced
    assert len({tuple(ids) for ids in by_id["req-13"]["completion_token_ids"]}) == 3 and by_id["req-13"]["params"]["seed"] == 4
    assert by_id["req-16"]["structured_output"] == {"choice": ["yes", "no"]}
    assert by_id["req-00"]["params"]["top_p"] == 1.0  # defaults resolved, not only the knobs sent
    assert AuditLog.verify(inline) == 21


def test_tampered_token_ids_are_reported_as_differing(logs, tmp_path, capsys) -> None:
    """A record whose completion ids were edited replays as differing at that token, with exit status 1."""
    inline, _ = logs
    records = _records(inline)
    target = next(r for r in records if r["request_id"] == "req-11")
    recorded = target["replay"]["completion_token_ids"][0]
    original = recorded[4]
    recorded[4] = original + 1
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in records))
    status, verdicts = _replay(capsys, str(tampered), "--request-id", "req-11")
    assert status == 1
    assert verdicts == {"req-11": f"differs at token 4: recorded {original + 1}, replayed {original}"}


def test_digest_records_replay_from_the_token_store(logs, tmp_path, capsys) -> None:
    """Digest mode keeps token ids out of the record; replay reads them from the store; a lost entry fails."""
    _, digest = logs
    records = {r["request_id"]: r for r in _records(digest)}
    record = records["req-03"]
    part = record["replay"]
    assert "prompt_token_ids" not in part and "completion_token_ids" not in part and len(part["prompt_digest"]) == 64
    assert part["store"] == "digest.jsonl.tokens" and len(part["completion_digests"]) == 2
    status, verdicts = _replay(capsys, str(digest), "--request-id", "req-03", "--request-id", "req-13")
    assert status == 0 and verdicts == {"req-03": "identical", "req-13": "identical"}

    moved = tmp_path / "moved"
    shutil.copytree(digest.parent / part["store"], moved)
    (moved / part["prompt_digest"][:2] / f"{part['prompt_digest']}.json").unlink()
    status, verdicts = _replay(capsys, str(digest), "--request-id", "req-03", "--store", str(moved))
    assert status == 1
    assert verdicts["req-03"].startswith("failed: line ") and "cannot read its replay part: token store" in verdicts["req-03"]


@pytest.fixture(scope="module")
def retrained(tiny_model_factory, tmp_path_factory) -> Path:
    """The tiny model's files with every weight nudged, under the same directory name: another model, same name."""
    import torch
    from safetensors.torch import load_file, save_file

    source = tiny_model_factory("llama")
    copy = tmp_path_factory.mktemp("retrained") / source.name
    shutil.copytree(source, copy)
    weights = copy / "model.safetensors"
    tensors = load_file(weights)
    noise = torch.Generator().manual_seed(1)
    save_file({k: t + 0.05 * torch.randn(t.shape, generator=noise) for k, t in tensors.items()}, weights, {"format": "pt"})
    return copy


def test_model_digest_names_the_weights_not_the_path(tiny_model_factory, retrained, tmp_path) -> None:
    """The same files elsewhere have the same digest; the same name and config with other weights do not."""
    from sdk.hooks.replay import model_digest

    source = tiny_model_factory("llama")
    moved = shutil.copytree(source, tmp_path / "elsewhere")
    assert model_digest(moved) == model_digest(source) != model_digest(retrained)
    assert (retrained / "config.json").read_text() == (source / "config.json").read_text()


def test_a_different_model_is_refused_unless_forced(logs, retrained, capsys) -> None:
    """Replaying on a model whose digest differs is refused, naming both digests; --force runs it (and it differs)."""
    from sdk.hooks.replay import model_digest

    inline, _ = logs
    record = next(r for r in _records(inline) if r["request_id"] == "req-01")
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(inline), "--request-id", "req-01", "--model", str(retrained)])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    recorded, found = record["replay"]["model_digest"], model_digest(retrained)
    assert (
        f"model identity differs for request req-01: it was served by model {record['model']!r} with digest {recorded}, "
        f"but {retrained} has digest {found}; pass --force to replay it anyway"
    ) in err
    status, verdicts = _replay(capsys, str(inline), "--request-id", "req-01", "--model", str(retrained), "--force")
    assert status == 1 and verdicts["req-01"].startswith("differs at token ")
