"""``Engine.stats()``: one engine's figures, gathered from its parts under the names ``/metrics`` and ``paged bench``
share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.pooling.pooling_stats import PoolingStats

if TYPE_CHECKING:
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.scheduler import Scheduler
    from engine.metrics import RequestStats, SpecDecodeStats
    from engine.output_processor import OutputProcessor


def engine_stats(
    scheduler: Scheduler, kv_cache: KVCacheManager, outputs: OutputProcessor, runner: Any, requests: RequestStats,
    spec_decode: SpecDecodeStats, busy_seconds: float, pooling: PoolingStats | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The engine's figures.

    ``tenant_requests`` maps each active tenant ("" for requests without one) to its
    ``{"running", "waiting"}`` requests; ``tenant_computed_tokens`` maps every tenant seen
    to the tokens computed for it; ``request_success`` maps finish reasons to requests.

    Args:
        scheduler, kv_cache, outputs, runner: the engine's parts.
        requests, spec_decode: what the engine counted of its requests and drafts.
        busy_seconds: the time it spent stepping.
        pooling: a pooling model's batch figures (``engine.pooling.pooling_stats``); None: a generative model's
            (``pooling`` then holds every kind at zero, so the series exist).
    """
    kv, fair = kv_cache.stats(), scheduler.fair
    encoder_cache = getattr(runner, "encoder_cache", None)  # None: a text-only model
    return {
        "num_requests_running": scheduler.num_running,
        "num_requests_waiting": scheduler.num_waiting,
        "kv_blocks_total": kv.num_blocks,
        "kv_blocks_used": kv.num_used_blocks,
        "kv_blocks_cached": kv.num_cached_blocks,
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "prompt_tokens_computed": scheduler.num_prompt_tokens_computed,
        "generation_tokens": outputs.num_generation_tokens,
        "num_preemptions": scheduler.num_preemptions,
        "ttft_seconds": outputs.ttft.snapshot(),
        "itl_seconds": outputs.itl.snapshot(),
        **requests.snapshot(),
        **spec_decode.snapshot(),
        "kv_token_usage": kv.token_utilization,
        "kv_evictions": kv.num_evictions,
        # images the vision encoder ran on, and images whose rows came from the encoder cache
        "mm_encoder_runs": 0 if encoder_cache is None else encoder_cache.num_encoded,
        "mm_encoder_cache_hits": 0 if encoder_cache is None else encoder_cache.num_hits,
        "tenant_requests": {
            tenant or "": {"running": running, "waiting": waiting}
            for tenant, (running, waiting) in fair.tenant_requests().items()
        },
        "tenant_computed_tokens": {tenant or "": n for tenant, n in fair.computed_tokens().items()},
        # output tokens per second of time spent stepping
        "generation_tokens_per_second": outputs.num_generation_tokens / busy_seconds if busy_seconds else 0.0,
        # pooling inputs (embeddings, scored pairs), their tokens and the batches they ran in (0 for a generative model)
        "pooling_requests": getattr(runner, "num_pooled_requests", 0),
        "pooling_tokens": getattr(runner, "num_pooled_tokens", 0),
        "pooling_batches": getattr(runner, "num_pooled_batches", 0),
        # by kind ("embed", "score"): inputs, tokens, batches, queue and compute seconds per input, inputs per batch
        "pooling": (pooling or PoolingStats()).snapshot(),
        # what the linear weights run as: {"quantization", "modules": {kind: count}, "bytes", "products"}
        "weights": runner.weights.as_dict(),
        # what serves attention, e.g. "cpu (bfloat16 cache; tiles of 48 queries, their shared keys on avx512-bf16)"
        "attention": runner.attention,
        # what runs the decoder layers: "one C call a step" (DecoderPlan) or "modules" (enforce_eager, GPU, ...)
        "layers": runner.layers,
    }
