"""Which rank of which tensor-parallel group, and which pipeline stage, a model is built for; how a dimension
splits by rank and the decoder layers by stage.

Layers read the group they belong to when they are built (``current_tensor_parallel()``, set by
``tensor_parallel(tp)`` around a model's construction, as the forward context scopes a step's metadata), and a
decoder its stage (``current_pipeline_stage()``, set by ``pipeline_stage(stage)``); outside such blocks a model
is built whole (one rank of one, one stage of one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from engine.errors import ParameterError


class Collectives(Protocol):
    """The collectives the parallel layers call on their group (``engine.distributed.communicator``)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place."""

    def all_reduce_min(self, value: int) -> int:
        """The least of each rank's ``value``."""

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """On rank 0, every rank's ``x`` side by side along the last dimension (rank order); None elsewhere."""


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``comm`` runs the collectives (None for one rank)."""

    rank: int = 0
    size: int = 1
    comm: Collectives | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0


SINGLE = TensorParallel()
_current = SINGLE


@contextlib.contextmanager
def tensor_parallel(tp: TensorParallel) -> Iterator[None]:
    """Layers built inside take ``tp``'s shard."""
    global _current
    previous, _current = _current, tp
    try:
        yield
    finally:
        _current = previous


def current_tensor_parallel() -> TensorParallel:
    """The group the layers being built belong to (``SINGLE`` outside ``tensor_parallel``)."""
    return _current


class Shard(NamedTuple):
    """A rank's ``count`` units from unit ``start`` of a dimension of ``units`` units (heads, rows, columns)."""

    start: int
    count: int


def shard_units(units: int, tp: TensorParallel, what: str) -> Shard:
    """Rank ``tp.rank``'s units: an equal share where ``units`` divides by the ranks; one unit replicated on
    ``size / units`` ranks where the ranks divide by ``units`` (KV heads fewer than ranks).

    Raises:
        ParameterError: (``tensor_parallel_size``) neither divides the other; ``what`` names the dimension.
    """
    if units % tp.size == 0:
        per_rank = units // tp.size
        return Shard(tp.rank * per_rank, per_rank)
    if tp.size % units == 0:
        return Shard(tp.rank * units // tp.size, 1)
    raise ParameterError(
        "tensor_parallel_size",
        f"tensor_parallel_size={tp.size} splits neither the model's {units} {what} nor a multiple of them",
    )


TENSOR_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""The dense Llama-family models whose layers split across ranks."""


def check_tensor_parallel(hf_config, size: int) -> None:
    """That a dense Llama-family model of ``hf_config`` splits over ``size`` ranks.

    Query heads, the MLP's intermediate size and the vocabulary split evenly; KV heads split evenly, or are
    replicated where they are fewer than the ranks and divide them.

    Raises:
        ParameterError: (``tensor_parallel_size``) a dimension that does not split, or a model type outside
            ``TENSOR_PARALLEL_MODEL_TYPES``.
    """
    if size == 1:
        return
    if hf_config.model_type not in TENSOR_PARALLEL_MODEL_TYPES:
        raise ParameterError(
            "tensor_parallel_size",
            f"tensor_parallel_size={size} serves {', '.join(TENSOR_PARALLEL_MODEL_TYPES)} models, "
            f"not {hf_config.model_type}",
        )
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for units, what in ((heads, "attention heads"), (hf_config.intermediate_size, "MLP features"),
                        (hf_config.vocab_size, "vocabulary rows")):
        if units % size:
            raise ParameterError(
                "tensor_parallel_size",
                f"tensor_parallel_size={size} does not divide the model's {units} {what}",
            )
    shard_units(kv_heads, TensorParallel(0, size), "KV heads")


PIPELINE_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text",
                                 "phi3")
"""The text decoders whose layers split into pipeline stages (every one but the multimodal ``llava``)."""


def check_pipeline_parallel(hf_config, size: int) -> None:
    """That ``hf_config``'s model splits into ``size`` pipeline stages (layer counts: ``stage_layers``).

    Raises:
        ParameterError: (``pipeline_parallel_size``) a model type outside ``PIPELINE_PARALLEL_MODEL_TYPES``.
    """
    if size > 1 and hf_config.model_type not in PIPELINE_PARALLEL_MODEL_TYPES:
        raise ParameterError(
            "pipeline_parallel_size",
            f"pipeline_parallel_size={size} serves {', '.join(PIPELINE_PARALLEL_MODEL_TYPES)} models, "
            f"not {hf_config.model_type}",
        )


class StageLinks(Protocol):
    """What a pipeline stage sends to and receives from the others (``engine.distributed.pipeline``);
    ``wait_seconds``, the time it spent waiting on them so far (its idle time)."""

    wait_seconds: float

    def all_reduce_min(self, value: int) -> int:
        """The least of every rank's ``value`` (all stages, all tensor-parallel ranks)."""

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The previous stage's hidden states and residual, stacked ``[2, T, hidden]``."""

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """This stage's hidden states and residual, stacked ``[2, T, hidden]``, to the next stage."""

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage's logits to the driver (rank 0)."""

    def recv_logits(self, shape: tuple[int, ...]) -> torch.Tensor:
        """On the driver, the last stage's float32 logits."""


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``rank`` of ``size``, holding the decoder layers ``layers``; ``links`` reach the other stages (None for
    one stage). ``layers`` None: all of them."""

    rank: int = 0
    size: int = 1
    layers: range | None = None
    links: StageLinks | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds(self, layer: int) -> bool:
        """Whether this stage holds decoder layer ``layer``."""
        return self.layers is None or layer in self.layers


WHOLE = PipelineStage()
_current_stage = WHOLE


@contextlib.contextmanager
def pipeline_stage(stage: PipelineStage) -> Iterator[None]:
    """Models built inside hold ``stage``'s layers only (the embedding on the first stage, the head on the last)."""
    global _current_stage
    previous, _current_stage = _current_stage, stage
    try:
        yield
    finally:
        _current_stage = previous


def current_pipeline_stage() -> PipelineStage:
    """The stage the model being built belongs to (``WHOLE`` outside ``pipeline_stage``)."""
    return _current_stage


def stage_layers(num_layers: int, size: int, partition: str | None = None) -> list[range]:
    """Each stage's contiguous decoder layers: ``partition``'s counts ("4,4,3,5", one per stage, summing to the
    layers), else an even split, the first ``num_layers % size`` stages one layer more (the last stage also runs
    the output head).

    Raises:
        ParameterError: (``pipeline_parallel_size``) fewer layers than stages; (``pipeline_layer_partition``) counts
            that are not one positive integer per stage summing to the layers.
    """
    if partition is None:
        if num_layers < size:
            raise ParameterError(
                "pipeline_parallel_size",
                f"pipeline_parallel_size={size} exceeds the model's {num_layers} decoder layers",
            )
        counts = [num_layers // size + (stage < num_layers % size) for stage in range(size)]
    else:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            counts = []
        if len(counts) != size or min(counts) < 1 or sum(counts) != num_layers:
            raise ParameterError(
                "pipeline_layer_partition",
                f"pipeline_layer_partition={partition!r} must give {size} positive layer counts summing to the "
                f"model's {num_layers} decoder layers",
            )
    starts = [sum(counts[:stage]) for stage in range(size + 1)]
    return [range(starts[stage], starts[stage + 1]) for stage in range(size)]
