"""``paged replay``: re-run audited requests on an in-process engine and compare them token for token.

Reads an audit log written with ``AuditLog(path, replay="inline" | "digest")``. Each greedy
or seeded request is run again on an engine loaded from the model its record names (or
``--model``), with the record's prompt ids, sampling parameters and engine settings, and
its completions are compared with the recorded ones. Per request it prints ``identical``,
the first differing token, or why the request cannot be replayed (sampled without a seed,
ended by an abort or a filter, no replay part). Exit status 1 when any request differs or
could not be run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from engine.errors import EngineError, ModelLoadError, ParameterError
from engine.loader import resolve_model
from engine.sampling_params import SAMPLING_EPS
from integrations.errors import CommandError
from sdk.hooks import AuditChainBroken, AuditLog
from sdk.hooks.replay import (
    REPLAYABLE_FINISH_REASONS,
    ReplayInputs,
    TokenStore,
    TokenStoreError,
    engine_version,
    model_digest,
    read_replay_part,
)

EngineKey = tuple[str | None, tuple[tuple[str, Any], ...]]  # (model to load, engine settings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("record_file", metavar="RECORD_FILE", help="an audit log (JSON lines) written with AuditLog(replay=...)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--request-id", action="append", metavar="ID", help="replay the request with this id (repeatable)")
    which.add_argument("--all", action="store_true", help="replay every record of the file")
    parser.add_argument(
        "--model", default=None, metavar="PATH",
        help="load this HF directory or .gguf file instead of the model each record names",
    )  # fmt: skip
    parser.add_argument(
        "--store", default=None, metavar="DIR",
        help="token store of digest-mode records (default: the one each record names, beside the log)",
    )  # fmt: skip
    parser.add_argument(
        "--force", action="store_true", help="replay even when the loaded model's identity differs from the record's"
    )


def run(args: argparse.Namespace) -> int:
    return replay(Path(args.record_file), args.request_id, args.model, args.store, args.force, sys.stdout)


@dataclass(frozen=True, slots=True)
class _Case:
    """One replayable record and the engine it runs on."""

    inputs: ReplayInputs
    model: str | None  # what to load: --model or the record's model path (None = bundled)
    settings: tuple[tuple[str, Any], ...]  # engine settings, hashable to group cases by engine


def replay(
    record_file: Path, request_ids: list[str] | None, model: str | None, store: str | None, force: bool, out: TextIO
) -> int:
    """Replay the records of ``record_file`` (those of ``request_ids``, or all) and report on ``out``.

    Returns:
        0 when every replayable request gave identical tokens, 1 when any differed or failed.

    Raises:
        CommandError: the file cannot be read, a requested id has no record, or a record's
            model identity differs from the model to load (without ``force``).
    """
    records = list(_read(record_file))
    try:
        AuditLog.verify(record_file)
    except AuditChainBroken as exc:
        print(f"warning: {exc}; replaying the records as they are", file=sys.stderr)
    if request_ids is not None:
        found = {r["request_id"] for _, r in records}
        if missing := [i for i in request_ids if i not in found]:
            raise CommandError(f"{record_file}: no record with request_id {', '.join(missing)}")
        records = [(n, r) for n, r in records if r["request_id"] in request_ids]

    cases: list[_Case] = []
    num_skipped = num_failed = 0
    for line, record in records:
        request_id = record.get("request_id")
        reason = _not_replayable(record)
        if reason is not None:
            print(f"{request_id}: not replayable: {reason}", file=out)
            num_skipped += 1
            continue
        try:
            inputs = read_replay_part(record, _token_store(record_file, record["replay"], store))
        except (TokenStoreError, KeyError, TypeError, ValueError) as exc:
            detail = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
            print(f"{request_id}: failed: line {line}: cannot read its replay part: {detail}", file=out)
            num_failed += 1
            continue
        settings = tuple(sorted((inputs.engine_settings or {}).items()))
        cases.append(_Case(inputs, model if model is not None else inputs.model_path, settings))

    _check_identities(cases, force)
    num_identical = 0
    for (case_model, settings), group in _by_engine(cases).items():
        try:
            replayed = _run_group(case_model, dict(settings), group)
        except (EngineError, ModelLoadError, ParameterError) as exc:  # a setting or prompt it refuses, a failed step
            for case in group:
                print(f"{case.inputs.request_id}: failed: the engine could not replay it: {exc}", file=out)
            num_failed += len(group)
            continue
        for case, outputs in zip(group, replayed):
            verdict = _compare(case.inputs.completion_token_ids, outputs)
            print(f"{case.inputs.request_id}: {verdict or 'identical'}", file=out)
            if verdict is None:
                num_identical += 1
            else:
                num_failed += 1
    print(f"{num_identical} identical, {num_failed} differ or failed, {num_skipped} not replayable", file=out)
    return 1 if num_failed else 0


def _read(record_file: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each JSON line; a line that is not a JSON object is an error."""
    try:
        lines = record_file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CommandError(f"cannot read {record_file}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise CommandError(f"{record_file}: line {number} is not a JSON record") from None
        if not isinstance(record, dict):
            raise CommandError(f"{record_file}: line {number} is not a JSON object")
        yield number, record


def _token_store(record_file: Path, part: dict[str, Any], store: str | None) -> TokenStore | None:
    """The token store of a digest record: ``--store`` as typed, else the record's, relative to the log's folder."""
    if store is not None:
        return TokenStore(store)
    return None if part.get("store") is None else TokenStore(record_file.parent / part["store"])


def _not_replayable(record: dict[str, Any]) -> str | None:
    """Why a record cannot be replayed, or None when it can."""
    if "replay" not in record:
        return "the record has no replay part (written without AuditLog(replay=...))"
    part = record["replay"]
    if part is None:
        return "the request never reached the engine"
    if record.get("error") is not None or record.get("finish_reason") not in REPLAYABLE_FINISH_REASONS:
        return f"it ended by {record.get('error') or record.get('finish_reason')}, not by the model"
    if part.get("model_digest") is None:
        return "the record has no model identity (it was not served by an in-process engine)"
    params = part.get("params") or {}
    if params.get("seed") is None and params.get("temperature", 1.0) >= SAMPLING_EPS:
        return f"sampled (temperature={params.get('temperature')}) without a seed: its tokens were random"
    return None


def _check_identities(cases: list[_Case], force: bool) -> None:
    """Refuse (or with ``force`` warn) where the model to load is not the model a record was served by."""
    digests: dict[str | None, str] = {}
    for case in cases:
        if case.model not in digests:
            try:
                digests[case.model] = model_digest(resolve_model(case.model))
            except ModelLoadError as exc:
                raise CommandError(f"cannot load the model of request {case.inputs.request_id}: {exc}") from None
        found, recorded = digests[case.model], case.inputs.model_digest
        if found != recorded:
            message = (
                f"model identity differs for request {case.inputs.request_id}: it was served by model "
                f"{case.inputs.model!r} with digest {recorded}, but {case.model or 'the bundled model'} has digest {found}"
            )
            if not force:
                raise CommandError(f"{message}; pass --force to replay it anyway")
            print(f"warning: {message}; replaying anyway (--force)", file=sys.stderr)
        if case.inputs.engine_version != engine_version():
            print(
                f"warning: request {case.inputs.request_id} was served by paged {case.inputs.engine_version}, "
                f"this is {engine_version()}",
                file=sys.stderr,
            )


def _by_engine(cases: list[_Case]) -> dict[EngineKey, list[_Case]]:
    groups: dict[EngineKey, list[_Case]] = {}
    for case in cases:
        groups.setdefault((case.model, case.settings), []).append(case)
    return groups


def _run_group(model: str | None, settings: dict[str, Any], group: list[_Case]) -> list[list[list[int]]]:
    """Per case, the token ids of each completion, from one engine running the group as one batch."""
    from engine import Engine

    engine = Engine(model, **settings)
    outputs = engine.generate(
        [c.inputs.prompt_token_ids for c in group], [c.inputs.params for c in group], use_tqdm=False
    )
    return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]


def _compare(recorded: list[list[int]], replayed: list[list[int]]) -> str | None:
    """None when every completion matches, else where the first one differs."""
    if len(recorded) != len(replayed):
        return f"differs: {len(replayed)} completions replayed, {len(recorded)} recorded"
    for index, (want, got) in enumerate(zip(recorded, replayed)):
        if want == got:
            continue
        position = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        choice = f" of completion {index}" if len(recorded) > 1 else ""
        if position < min(len(want), len(got)):
            return f"differs at token {position}{choice}: recorded {want[position]}, replayed {got[position]}"
        return f"differs at token {position}{choice}: recorded {len(want)} tokens, replayed {len(got)}"
    return None
