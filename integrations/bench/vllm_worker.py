"""Runs one bench workload through vLLM's offline ``LLM.generate``; run by the vLLM environment's python.

Usage: ``python vllm_worker.py REQUEST.json RESULT.json``. It imports only the standard library
and vLLM: that environment has neither this project nor its dependencies.

REQUEST: ``{"model": HF_DIR, "prompts": [[token id, ...], ...], "max_tokens", "dtype",
"enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "seed"}``.

RESULT: ``{"vllm": version, "dtype", "init_s", "wall_s", "num_new_tokens", "tokens_per_s",
"token_ids": [[...], ...], "num_cached_tokens": [int | null, ...]}``, in the prompts' order.

An EMBED REQUEST (``"task": "embed"``: ``"model", "dtype", "texts", "rounds", "query", "num_queries"``) runs the
model as a pooling model through ``LLM.embed``: after an untimed warm-up, ``texts`` ``rounds`` times, then
``query`` alone ``num_queries`` times. Its RESULT: ``{"vllm", "dtype", "init_s", "rounds_s": [...],
"query_s": [...], "embeddings": [the first EMBEDDINGS_KEPT texts' vectors]}``.

Every prompt is submitted at once and decoded greedily to exactly ``max_tokens`` new tokens
(EOS ignored). ``init_s`` is the ``LLM`` construction (loading, compiling, cache allocation);
``wall_s`` is the one timed ``generate``, after a warm-up on an unrelated prompt and a prefix
cache reset, so neither start-up nor first-call costs are measured.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

WARM_UP_PROMPT = [1, 2, 3, 4]
EMBEDDINGS_KEPT = 8  # vectors returned, for the bench to compare with the engine's
# The REQUEST keys that are ``LLM``'s arguments of the same name.
LLM_ARGUMENTS = ("model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                 "seed")  # fmt: skip


def run(request: dict[str, Any]) -> dict[str, Any]:
    """The workload in ``request`` through vLLM; returns the RESULT document."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(**{key: request[key] for key in LLM_ARGUMENTS})
    init_s = time.perf_counter() - start
    llm.generate([TokensPrompt(prompt_token_ids=WARM_UP_PROMPT)], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.reset_prefix_cache()

    n = request["max_tokens"]
    params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    num_new_tokens = sum(len(t) for t in token_ids)
    return {
        "vllm": vllm.__version__,
        "dtype": request["dtype"],
        "init_s": init_s,
        "wall_s": wall_s,
        "num_new_tokens": num_new_tokens,
        "tokens_per_s": num_new_tokens / wall_s if wall_s > 0 else 0.0,
        "token_ids": token_ids,
        "num_cached_tokens": [getattr(o, "num_cached_tokens", None) for o in outputs],
    }


def run_embed(request: dict[str, Any]) -> dict[str, Any]:
    """The EMBED REQUEST through vLLM's ``LLM.embed``; returns its RESULT document."""
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=request["model"], dtype=request["dtype"], runner="pooling", seed=0)
    init_s = time.perf_counter() - start
    texts = request["texts"]
    llm.embed(texts[:32], use_tqdm=False)
    rounds_s, outputs = [], []
    for _ in range(request["rounds"]):
        start = time.perf_counter()
        outputs = llm.embed(texts, use_tqdm=False)
        rounds_s.append(time.perf_counter() - start)
    query_s = []
    for _ in range(request["num_queries"]):
        start = time.perf_counter()
        llm.embed([request["query"]], use_tqdm=False)
        query_s.append(time.perf_counter() - start)
    return {
        "vllm": vllm.__version__,
        "dtype": request["dtype"],
        "init_s": init_s,
        "rounds_s": rounds_s,
        "query_s": query_s,
        "embeddings": [list(o.outputs.embedding) for o in outputs[:EMBEDDINGS_KEPT]],
    }


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python vllm_worker.py REQUEST.json RESULT.json")
    request_path, result_path = (Path(a) for a in argv)
    request = json.loads(request_path.read_text())
    result = run_embed(request) if request.get("task") == "embed" else run(request)
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
