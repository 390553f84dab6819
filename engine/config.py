"""EngineConfig: the frozen settings of one engine, each declared once as a knob.

The command-line flags of ``paged serve`` and ``paged bench`` are generated from these
declarations (``integrations.engine_flags``): a field added here is a flag there, with the
same default and help.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from engine.errors import ParameterError
from engine.knobs import check_knobs, knob
from engine.spec_decode.config import SpeculativeConfig

DEFAULT_CPU_KV_CACHE_FRACTION = 0.3  # of the memory available at start-up, for the KV cache on CPU
DEFAULT_CPU_KV_CACHE_MIN = 256 << 20  # bytes: the CPU default's floor
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85  # fraction of free device memory for the KV cache


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine; every field has a default that suits the bundled model on CPU.

    ``kv_cache_memory`` (bytes) and ``num_blocks`` size the KV cache; give at most one.

    Raises:
        ParameterError: a field of the wrong type or outside its bounds (``param`` names it),
            both ``kv_cache_memory`` and ``num_blocks``, ``kv_cache_dir`` without
            ``enable_prefix_caching`` or with ``kv_cache_dtype="int8"``, ``pipeline_layer_partition`` without
            a pipeline, or ``kv_cache_save_interval_s`` without ``kv_cache_dir``.
    """

    model: str | os.PathLike[str] | None = knob(
        None, "HF model directory or .gguf file; None = the bundled SmolLM2-135M-Instruct."
    )
    runner: str = knob(
        "auto",
        "What the model is run for, as vLLM's setting of this name: auto = as its files say (an encoder, a "
        "sentence-transformers model or a *ForSequenceClassification architecture is a pooling model, the rest "
        "generate); pooling = embeddings or scores only, no KV cache for an encoder; generate = text.",
        choices=("auto", "generate", "pooling"),
    )
    convert: str = knob(
        "auto",
        "A pooling model's task, as vLLM's setting of this name: embed (Engine.embed; score by cosine), classify "
        "(a cross-encoder: Engine.score); auto = as its files say.",
        choices=("auto", "embed", "classify"),
    )
    dtype: str = knob(
        "auto",
        "Weights and compute dtype. auto = bfloat16 on CUDA; on CPU the checkpoint's dtype where it is bfloat16, "
        "else float32 (a float32 or float16 checkpoint); a GGUF file's float tensors and KV cache bfloat16 where the "
        "CPU has AVX512-BF16 or AMX, else float32. On CPU, bfloat16 keeps bfloat16 weights and KV cache and float32 "
        "element-wise parts; its matmuls run on AMX or AVX512-BF16 where the CPU has them, else widened to float32.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    quantization: str | None = knob(
        None,
        "Linear weights quantized on CPU: int8 = 8-bit min/max blocks of 32 weights (weight-only; the output head "
        "stays in dtype); w8a8 = symmetric 8-bit blocks of 32 weights, and each matmul's input quantized to symmetric "
        "int8 blocks of 32 (both Hadamard-rotated) as it comes, the products in int8 (AVX512-VNNI where the CPU has "
        "it; the output head in dtype); gguf = a .gguf file's own blocks (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, "
        "Q5_0, Q5_1, F16, BF16, F32) times int8 blocks of x, read from the file without dequantizing, the same as "
        "None for a .gguf; None = weights in dtype (a .gguf: its own blocks).",
        choices=("int8", "w8a8", "gguf"),
    )
    batched_weights_memory: int = knob(
        512 << 20,
        "Bytes a GGUF model's second layout of its linear weights may take: made from the file's blocks at load "
        "(int8 blocks for int8 products on AVX512-VNNI with the output head in bfloat16, else bfloat16), it "
        "multiplies the steps of 4 rows or more, where the blocks' kernels are several times slower; smaller "
        "steps read the blocks. Held only where all of it fits (the bundled 135M model's takes 168 MiB; a 1.7B "
        "model's about 1.7 GiB does not). 0 = the blocks alone, whose greedy output does not depend on batching.",
        ge=0, le=1 << 50, unit="bytes",
    )  # fmt: skip
    device: str = knob("auto", "auto = cuda when available, else cpu.", choices=("auto", "cpu", "cuda"))
    block_size: int = knob(16, "Tokens per KV cache block.", ge=1, le=1024)
    kv_cache_memory: int | None = knob(
        None,
        "KV cache size in bytes; None = 30% of the memory available at start-up on CPU (at least 256 MiB; "
        "pages are committed as blocks fill; no more than max_num_seqs sequences of max_model_len fill), "
        "85% of free device memory on GPU (or num_blocks).",
        ge=1, le=1 << 50, unit="bytes",
    )  # fmt: skip
    num_blocks: int | None = knob(None, "KV cache size in blocks, instead of kv_cache_memory.", ge=1, le=1 << 32)
    kv_cache_prefault: bool = knob(
        False,
        "Commit the whole CPU KV cache at start-up, as vLLM allocates its cache: no page faults when a block is "
        "first written, for start-up time and the whole cache's memory at once (False: pages are committed as "
        "blocks fill).",
    )
    kv_cache_dtype: str = knob(
        "auto",
        "KV cache elements, as vLLM's setting of this name: auto = the weights' dtype on CPU (float32 or bfloat16), "
        "the compute dtype on GPU; int8 = int8 codes with a float32 scale per block and KV head for each of K and V "
        "(the CPU attention kernels; a quarter of a float32 cache's bytes, half a bfloat16 one's, so twice the "
        "blocks of bfloat16 for the same memory; its accuracy: docs/kv_cache.md); not with kv_cache_dir.",
        choices=("auto", "int8"),
    )
    max_num_seqs: int = knob(128, "Most requests running in one step.", ge=1, le=1 << 16)
    max_num_batched_tokens: int | None = knob(
        None,
        "Token budget of one step (decode tokens plus prefill chunks); None = 512 on CPU (a step's activations stay "
        "in cache, and decode tokens wait less behind a prompt's chunk), 2048 on GPU.",
        ge=1, le=1 << 24,
    )  # fmt: skip
    itl_target_s: float | None = knob(
        0.5,
        "Seconds a step that holds decodes should take (their inter-token latency): the step's prompt chunks are "
        "cut to the tokens its measured cost per token leaves room for (32 at least, so prompts still advance); "
        "None = prompt chunks take all of max_num_batched_tokens that the decodes leave.",
        gt=0.0, le=3600.0,
    )  # fmt: skip
    pooling_time_fraction: float = knob(
        0.25,
        "While this (chat) engine has requests, the pooling engines beside it in the process (an embedder, a reranker) "
        "run at most this fraction of its measured step time between two of its steps: their batches run a layer "
        "at a time and resume where they stopped (one layer a turn at least, so embeddings always progress). "
        "With no chat request, pooling runs whole batches of its full budget.",
        gt=0.0, le=16.0,
    )  # fmt: skip
    max_model_len: int | None = knob(None, "Longest prompt + completion in tokens; None = the model's.", ge=1, le=1 << 24)
    enable_prefix_caching: bool = knob(True, "Share the KV blocks of equal prompt prefixes between requests.")
    kv_cache_dir: str | os.PathLike[str] | None = knob(
        None,
        "Directory the KV cache persists to: on close() and every kv_cache_save_interval_s it holds the cached "
        "blocks of pinned prefixes and the kv_cache_save_hot_blocks most recently used; an engine started on it "
        "loads those of its model, dtypes, block size and KV layout, checksummed and hash-checked. Under tensor or "
        "pipeline parallelism each rank saves and loads its own KV heads and layers, a block's file holding every "
        "rank's part: a directory serves the same split only. None = nothing persists.",
    )
    kv_cache_save_interval_s: float | None = knob(
        None, "Seconds between saves to kv_cache_dir, taken between steps; None = on close() only.", gt=0.0, le=86400.0
    )
    kv_cache_save_hot_blocks: int = knob(
        64, "Cached blocks saved to kv_cache_dir besides pinned prefixes, most recently used first (with the "
        "blocks before them in their prompts).", ge=0, le=1 << 32,
    )  # fmt: skip
    attention_backend: str = knob(
        "auto",
        "auto = triton on CUDA; on CPU the C kernels (cpu) when they build here and serve the dtype "
        "and head shapes, else torch.",
        choices=("auto", "torch", "cpu", "triton"),
    )
    enforce_eager: bool = knob(
        False,
        "Run the model module by module in Python, as vLLM's flag of this name keeps eager mode (False: on CPU "
        "with the C kernels, a Llama-family model's decoder layers run as one C call a step, the same kernels "
        "without the Python between them).",
    )
    tensor_parallel_size: int = knob(
        1,
        "Ranks that split the model (Megatron-style tensor parallelism on torch.distributed: gloo on CPU, NCCL on "
        "CUDA, one process per rank, each holding its share of the weights and KV heads); 1 = one process. "
        "Dense Llama-family models whose heads, MLP and vocabulary divide by it.",
        ge=1, le=64,
    )  # fmt: skip
    pipeline_parallel_size: int = knob(
        1,
        "Pipeline stages the decoder layers split into (contiguous layers per stage, each stage's ranks holding only "
        "their layers' weights and KV cache; hidden states passed stage to stage on torch.distributed, the first "
        "stage embedding, the last computing the logits); tensor_parallel_size ranks per stage; 1 = no pipeline. "
        "Text decoders with at least as many layers as stages.",
        ge=1, le=64,
    )  # fmt: skip
    pipeline_layer_partition: str | None = knob(
        None,
        "Decoder layers per pipeline stage as comma-separated counts summing to the model's layers (\"10,14\"), as "
        "vLLM's VLLM_PP_LAYER_PARTITION; None = an even split, the first stages one layer more where it is uneven.",
    )
    distributed_executor_backend: str = knob(
        "mp",
        "Where the ranks of tensor_parallel_size x pipeline_parallel_size run, as vLLM's setting of this name: mp = "
        "processes this one spawns on its machine; ray = Ray actors in one placement group, on the Ray cluster this "
        "process is connected to (else a local one), across nodes as ray_placement_strategy places them.",
        choices=("mp", "ray"),
    )
    ray_placement_strategy: str = knob(
        "PACK", "How the Ray ranks' bundles spread over nodes: PACK = as few nodes as fit, SPREAD = as many.",
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    )
    ray_bundle_cpus: float = knob(
        1.0, "CPUs each Ray rank's bundle reserves (and a GPU on CUDA); inside a Ray placement group (a Serve "
        "replica's), rank r takes that group's bundle r instead.", gt=0.0, le=1024.0,
    )  # fmt: skip
    ray_placement_timeout_s: float = knob(
        60.0, "Seconds the Ray cluster has to hold the ranks' placement group before start-up fails naming it "
        "(none is reserved inside a Ray placement group: the ranks take its bundles).", gt=0.0, le=86400.0,
    )
    max_queued_requests: int = knob(4096, "Admission limit: waiting requests (beyond it, EngineOverloaded).", ge=1, le=1 << 30)
    max_queued_tokens: int = knob(
        4_000_000, "Admission limit: prompt tokens of waiting requests (beyond it, EngineOverloaded).", ge=1, le=1 << 40
    )
    speculative_config: SpeculativeConfig | None = knob(
        None,
        "Speculative decoding, as vLLM's setting of this name: a JSON object such as "
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2} '
        "(drafts found in the request's own tokens, verified in one forward pass; outputs as without it). "
        "None = off.",
    )
    seed: int = knob(0, "Seeds the sampling of requests without a seed of their own.", ge=0, le=(1 << 63) - 1)

    def __post_init__(self) -> None:
        check_knobs(self)
        if self.kv_cache_memory is not None and self.num_blocks is not None:
            raise ParameterError("num_blocks", "give kv_cache_memory or num_blocks, not both")
        if self.kv_cache_dir is not None and not self.enable_prefix_caching:
            raise ParameterError("kv_cache_dir", "kv_cache_dir persists the prefix cache: it needs enable_prefix_caching")
        if self.kv_cache_save_interval_s is not None and self.kv_cache_dir is None:
            raise ParameterError("kv_cache_save_interval_s", "kv_cache_save_interval_s needs kv_cache_dir")
        if self.kv_cache_dir is not None and self.kv_cache_dtype == "int8":
            raise ParameterError("kv_cache_dtype", "kv_cache_dir persists float32 and bfloat16 caches; not int8")
        if self.pipeline_layer_partition is not None and self.pipeline_parallel_size == 1:
            raise ParameterError("pipeline_layer_partition", "pipeline_layer_partition needs pipeline_parallel_size above 1")


def step_token_budget(max_num_batched_tokens: int | None, device_type: str) -> int:
    """The token budget of one step: ``max_num_batched_tokens``, or its default for the device ("cpu", "cuda")."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    return 512 if device_type == "cpu" else 2048


def make_config(model: str | None, config: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    """``Engine(model, **config)`` / ``Engine(config=...)`` -> one EngineConfig."""
    if config is None:
        return EngineConfig(model=model, **overrides)
    if model is not None:
        overrides = {**overrides, "model": model}
    return replace(config, **overrides) if overrides else config
