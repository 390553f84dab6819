"""Which rank of which tensor-parallel group a model is built for, and how a dimension splits by rank.

Layers read the group they belong to when they are built (``current_tensor_parallel()``, set by
``tensor_parallel(tp)`` around a model's construction, as the forward context scopes a step's metadata);
outside such a block a model is built whole (one rank of one).
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
