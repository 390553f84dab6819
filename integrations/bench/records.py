"""The results file: every recorded ``paged bench`` run, one JSON document a line, in the order they ran.

``paged bench --record`` appends its run to ``RESULTS_FILE``; ``paged figures`` renders the docs' tables from
it (``integrations/bench/figures.py``). A record is the run's report (``report.py``'s layout, its ``model``
section included; the profile without its trace's path) with what it ran on and how::

    {"schema": 1, "date": "YYYY-MM-DD", "commit": sha | null, "dirty": bool | null, "recorded_in": sha | null,
     "source": str, "command": "VAR=... paged bench ...", "environment": {VAR: value},
     "workload": {...}, "machine": {...}, "model": {...}, "protocol": {...}, "results": [...], "rounds": ...,
     "batch1": ..., ...}

``commit`` is the engine's git commit and ``dirty`` whether files outside ``docs/`` differed from it.
Runs measured before records were kept were copied in from the docs that carried them: their ``commit``
is null, ``recorded_in`` names the commit whose docs first carried the run (the engine measured is that
commit's or an earlier one's) and ``source`` the page that describes it.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from integrations.errors import CommandError

RESULTS_FILE = Path("docs/results/benchmarks.jsonl")  # from the project's folder
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout whose commit a record names
RECORD_SOURCE = "paged bench --record"
REQUIRED = ("schema", "date", "command", "machine", "model", "workload", "protocol", "results")
# What changes a run's speed besides its flags: the OpenMP runtime's, vLLM's CPU binding and the engine's kernel
# choices. Nothing else is recorded (other variables can hold keys and paths).
SPEED_ENV_PREFIXES = ("OMP_", "KMP_", "VLLM_CPU_")
# Set by scikit-learn (imported with sentence-transformers) in its own process: they change no speed.
NOT_SPEED_ENV = ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")
OUTPUT_FLAGS = ("--json", "--plot")  # where a run wrote its files: no part of what it measured
SPEED_ENV = ("PAGED_CPU_KERNELS", "PAGED_ATTENTION_FETCH", "PAGED_ATTENTION_SPLIT", "PAGED_BF16_ATTENTION",
             "PAGED_BF16_LINEAR", "PAGED_GGML_LINEAR", "PAGED_INT8_LINEAR")  # fmt: skip
_MODEL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "max_position_embeddings")  # fmt: skip


class RecordError(CommandError):
    """A line of the results file that is not a record; the message names the file, the line and what is wrong."""


def describe_model(model: str | None, model_dir: Path) -> dict[str, Any]:
    """The report's ``model`` section: its name, the published shape it has (``paged make-model``'s names), its
    config's sizes and, for a GGUF, the file type (llama.cpp's name, e.g. ``Q4_K_M``)."""
    from engine.model_files.shapes import SHAPES
    from integrations.bench.llamacpp_runs import gguf_of

    config = json.loads((Path(model_dir) / "config.json").read_text())
    sizes = {key: config.get(key) for key in _MODEL_KEYS}
    shape = next(
        (
            s.name for s in SHAPES.values()
            if s.model_type == config.get("model_type") and all(s.config.get(k) == v for k, v in sizes.items())
        ),
        None,
    )  # fmt: skip
    gguf = gguf_of(model)
    return {
        "name": "bundled SmolLM2-135M-Instruct" if model is None else Path(model).name,
        "shape": shape,
        "model_type": config.get("model_type"),
        **sizes,
        "file_type": None if gguf is None else gguf_file_type(gguf),
    }


def gguf_file_type(path: Path) -> str:
    """A GGUF's ``general.file_type`` as llama.cpp names it (``Q4_K_M``), or ``type N`` for one not named here."""
    from engine.model_files.gguf import GGUFFile
    from engine.model_files.gguf_file_types import FILE_TYPES

    value = GGUFFile(path).metadata.get("general.file_type")
    names = {number: name for name, (number, _) in FILE_TYPES.items()}
    return names.get(int(value), f"type {value}") if value is not None else "unknown"


def make_record(
    report: dict[str, Any],
    command: Sequence[str],
    environ: dict[str, str] | None = None,
    today: datetime.date | None = None,
) -> dict[str, Any]:
    """The record of one run: ``report`` with the date, the engine's commit, the command line and the variables of
    ``environ`` (default: this process's) that change its speed. A path under the home folder is written from
    ``~``, so a record names no one's home."""
    environ = os.environ if environ is None else environ
    environment = {
        k: v
        for k, v in sorted(environ.items())
        if (k.startswith(SPEED_ENV_PREFIXES) or k in SPEED_ENV) and k not in NOT_SPEED_ENV
    }
    commit, dirty = git_commit(PROJECT_ROOT)
    words = [*(f"{k}={v}" for k, v in environment.items()), *_without_outputs(command)]
    record = {
        "schema": report["schema"],
        "date": (today or datetime.datetime.now(datetime.timezone.utc).date()).isoformat(),
        "commit": commit,
        "dirty": dirty,
        "recorded_in": None,
        "source": RECORD_SOURCE,
        "command": _home_relative(shlex.join(words)),
        "environment": environment,
        **{k: v for k, v in report.items() if k != "schema"},
    }
    record["protocol"] = {**report["protocol"], "model": report["model"]["name"]}
    if report.get("profile"):
        record["profile"] = {k: v for k, v in report["profile"].items() if k != "trace"}
    return json.loads(_home_relative(json.dumps(record)))


def _without_outputs(command: Sequence[str]) -> list[str]:
    """``command`` less its ``OUTPUT_FLAGS`` and their paths (``--json PATH`` or ``--json=PATH``)."""
    words: list[str] = []
    skip = False
    for word in command:
        if skip:
            skip = False
        elif word in OUTPUT_FLAGS:
            skip = True
        elif not word.startswith(tuple(f"{flag}=" for flag in OUTPUT_FLAGS)):
            words.append(word)
    return words


def _home_relative(text: str) -> str:
    home = str(Path.home())
    return text.replace(home + "/", "~/") if home not in ("/", "") else text


def git_commit(root: Path) -> tuple[str | None, bool | None]:
    """The commit checked out at ``root`` and whether files outside ``docs/`` differ from it; (None, None) where
    ``root`` is no git checkout (an installed package)."""
    if not (root / ".git").exists():
        return None, None
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return sha, bool(status.strip())


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Appends ``record`` to the results file at ``path`` as one line (the file and its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")


def load_records(path: Path) -> list[dict[str, Any]]:
    """Every record of the results file at ``path``, in its order.

    Raises:
        RecordError: a line that is not a JSON object holding the ``REQUIRED`` keys.
    """
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise RecordError(f"{path}:{number}: not JSON ({exc})") from None
        missing = [k for k in REQUIRED if not isinstance(record, dict) or k not in record]
        if missing:
            raise RecordError(f"{path}:{number}: a record needs {', '.join(missing)}")
        records.append(record)
    return records
