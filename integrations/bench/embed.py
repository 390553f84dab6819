"""``paged bench --workload embed``: embedding throughput and single-query latency beside sentence-transformers.

Protocol: ``--num-requests`` chunks of ``--chunk-tokens`` tokens each (seeded words), every contender in
this process on the same torch threads, taking turns for ``--rounds`` rounds after an untimed warm-up.
The engine gets all chunks in one ``Engine.embed`` call (its token-budget batches); sentence-transformers
``encode`` runs at each ``--batch-size``. Throughput is chunks / wall time, the median round's; the
single-query latency is the median of ``--queries`` one-text calls, the contenders taking turns call by call.
vLLM (``--baselines vllm``) runs in its own environment's process after the others, its rounds and queries
in a row, in the engine's dtype; its vectors of the first chunks are held to the engine's (least cosine).
llama.cpp (``--baselines llamacpp``) runs ``llama-server --embedding`` on a GGUF of the same model (a BERT
directory written as F32, or F16 for an engine in a 16-bit dtype, by ``gguf_bert_writer``) on the same threads,
after the others: requests of 32 chunks all sent at once, 8 sequences a batch.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from pathlib import Path
from typing import Any

from integrations.bench import llamacpp_runs, vllm_runs

ENGINE = "paged"
SENTENCE_TRANSFORMERS = "sentence-transformers"
QUERY = "what does the retrieval model map each chunk to"
_WORDS = (
    "the retrieval model reads each chunk of a document and maps it to a vector so that questions find the "
    "passages that answer them quickly across millions of pages while the language model writes an answer from "
    "what was found about engines caches batches tokens attention layers weights memory threads latency"
).split()


def make_chunks(tokenizer: Any, num_chunks: int, chunk_tokens: int, seed: int = 0) -> list[str]:
    """``num_chunks`` texts of seeded words, each ``chunk_tokens`` tokens long with the tokenizer's special tokens."""
    rng = random.Random(seed)
    special = len(tokenizer("")["input_ids"])
    chunks = []
    for _ in range(num_chunks):
        ids = tokenizer(" ".join(rng.choice(_WORDS) for _ in range(chunk_tokens)), add_special_tokens=False)["input_ids"]
        chunks.append(tokenizer.decode(ids[: chunk_tokens - special]))
    return chunks


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def embed_bench(
    model: str, engine_fields: dict[str, Any], num_chunks: int, chunk_tokens: int, batch_sizes: list[int],
    baselines: list[str], rounds: int, num_queries: int, vllm_python: Path | None = None,
    llamacpp: llamacpp_runs.LlamaCpp | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Runs the contenders (vLLM, when in ``baselines``, with ``vllm_python``: its environment's python; llama.cpp
    with the ``llamacpp`` build); returns ``{"rows": [{"name", "chunks_per_s", "tokens_per_s", "query_ms", ...}],
    ...}``."""
    import torch

    from engine import Engine

    engine = Engine(model=model, **engine_fields)
    if engine.task != "embed":
        raise ValueError(f"--workload embed needs an embedding model; {model!r} is a {engine.task} model")
    chunks = make_chunks(engine.tokenizer, num_chunks, chunk_tokens)
    num_tokens = sum(len(o.prompt_token_ids) for o in engine.embed(chunks[:8])) * num_chunks // 8
    contenders: dict[str, Any] = {ENGINE: lambda texts: engine.embed(texts)}
    if SENTENCE_TRANSFORMERS in baselines:
        from sentence_transformers import SentenceTransformer

        dtypes = [torch.float32] + ([engine.runner.dtype] if engine.runner.dtype != torch.float32 else [])
        for dtype in dtypes:
            st = SentenceTransformer(str(engine.model_dir), device="cpu", model_kwargs={"dtype": dtype})
            for batch_size in batch_sizes:
                name = f"{SENTENCE_TRANSFORMERS} {str(dtype).removeprefix('torch.')} batch {batch_size}"
                contenders[name] = lambda texts, st=st, b=batch_size: st.encode(texts, batch_size=b)
    for run in contenders.values():  # warm-up
        run(chunks[:32])
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            times[name].append(_timed(lambda run=run: run(chunks)))
    latencies: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(num_queries):  # NOTE: taking turns query by query, so a machine's drift falls on all alike
        for name, run in contenders.items():
            one = [QUERY] if name != ENGINE else QUERY
            latencies[name].append(_timed(lambda run=run, one=one: run(one)))
    rows = []
    for name in contenders:
        latency = statistics.median(latencies[name])
        wall = statistics.median(times[name])
        rows.append({
            "name": name, "wall_s": wall, "chunks_per_s": num_chunks / wall, "tokens_per_s": num_tokens / wall,
            "query_ms": latency * 1000, "rounds_s": times[name],
        })  # fmt: skip
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    if vllm_runs.VLLM in baselines:
        rows.append(_vllm_row(engine, vllm_python, chunks, dtype, rounds, num_queries, num_tokens))
    if llamacpp is not None:
        rows.append(_llamacpp_row(engine, llamacpp, chunks, rounds, num_queries, num_tokens))
    return {
        "rows": rows, "num_chunks": num_chunks, "chunk_tokens": chunk_tokens, "num_tokens": num_tokens,
        "threads": torch.get_num_threads(), "dtype": dtype,
    }  # fmt: skip


def _vllm_row(
    engine: Any, python: Path, chunks: list[str], dtype: str, rounds: int, num_queries: int, num_tokens: int
) -> dict[str, Any]:
    """vLLM's row: its rounds and queries in its own process; its vectors' least cosine to the engine's."""
    from engine.pooling.api import cosine

    result = vllm_runs.run_vllm_embed(python, engine.model_dir, chunks, dtype, rounds, QUERY, num_queries)
    ours = [o.outputs.embedding for o in engine.embed(chunks[: len(result["embeddings"])])]
    wall = statistics.median(result["rounds_s"])
    return {
        "name": f"vLLM {result['vllm']} {dtype}", "wall_s": wall, "chunks_per_s": len(chunks) / wall,
        "tokens_per_s": num_tokens / wall, "query_ms": statistics.median(result["query_s"]) * 1000,
        "rounds_s": result["rounds_s"], "startup_s": result["init_s"],
        "min_cosine": min(cosine(a, b) for a, b in zip(ours, result["embeddings"])),
    }  # fmt: skip


def _llamacpp_row(
    engine: Any, build: llamacpp_runs.LlamaCpp, chunks: list[str], rounds: int, num_queries: int, num_tokens: int
) -> dict[str, Any]:  # fmt: skip
    """llama-server's row: the model written as a GGUF (kept in the cache beside the engine's other conversions),
    its rounds and queries; its vectors' least cosine to the engine's."""
    import torch

    from engine.model_files.gguf_bert_writer import write_bert_gguf
    from engine.paths import cache_root
    from engine.pooling.api import cosine

    file_type = "F32" if engine.runner.dtype == torch.float32 else "F16"
    source = Path(engine.model_dir).resolve()
    key = hashlib.sha256(f"{source}:{(source / 'config.json').stat().st_mtime_ns}".encode()).hexdigest()[:12]
    gguf = cache_root() / "gguf-embedders" / f"{source.name}-{key}-{file_type}.gguf"
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        partial = gguf.with_suffix(".partial")
        write_bert_gguf(engine.model_dir, partial, file_type)
        partial.rename(gguf)
    threads = torch.get_num_threads()
    result = llamacpp_runs.run_llama_server_embed(build, gguf, chunks, threads, rounds, QUERY, num_queries)
    ours = [o.outputs.embedding for o in engine.embed(chunks[: len(result["embeddings"])])]
    wall = statistics.median(result["rounds_s"])
    return {
        "name": f"llama.cpp llama-server {file_type}, {llamacpp_runs.EMBED_SLOTS} slots", "wall_s": wall,
        "chunks_per_s": len(chunks) / wall, "tokens_per_s": num_tokens / wall,
        "query_ms": statistics.median(result["query_s"]) * 1000, "rounds_s": result["rounds_s"],
        "startup_s": result["startup_s"], "min_cosine": min(cosine(a, b) for a, b in zip(ours, result["embeddings"])),
    }  # fmt: skip


def format_embed(report: dict[str, Any]) -> str:
    """The rows as a table, each contender's throughput and latency as a ratio to the engine's."""
    rows = report["rows"]
    ours = next(r for r in rows if r["name"] == ENGINE)
    lines = [
        f"embed: {report['num_chunks']} chunks x {report['chunk_tokens']} tokens ({report['num_tokens']} tokens), "
        f"engine {report['dtype']}, {report['threads']} threads",
        "| contender | chunks/s | tokens/s | engine's speed-up | single query ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['chunks_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{ours['chunks_per_s'] / r['chunks_per_s']:.2f}x | {r['query_ms']:.2f} |"
        )
    for r in rows:
        if "startup_s" in r:
            lines.append(
                f"- {r['name']}: its own process, after the others; start-up {r['startup_s']:.0f} s (not timed); "
                f"least cosine to the engine's vectors {r['min_cosine']:.6f}"
            )
    return "\n".join(lines)
