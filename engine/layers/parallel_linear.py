"""Megatron-style tensor-parallel layers: each rank holds a slice of a weight and the collectives join them.

Built inside ``engine.parallel_state.tensor_parallel(tp)`` they take rank ``tp.rank``'s slice and
call ``tp.comm``'s collectives (a group of one rank calls them too: the GPU check runs NCCL so); built outside
they are the plain layers they extend, with no collective and the same checkpoint tensors whole.

- ``MergedColumnParallelLinear``: fused projections (q/k/v, gate/up), each shard's output rows split by rank
  in whole units (heads); a shard with fewer units than ranks (KV heads) is replicated.
- ``RowParallelLinear``: the input features split by rank; the partial outputs all-reduced, the bias added once.
- ``VocabParallelEmbedding``: the vocabulary's rows split by rank; each rank looks up the ids it holds (zeros
  for the others) and an all-reduce sums them. Tied to the output head, it is that head too.
- ``ParallelLMHead``: the vocabulary's rows split by rank; the logits gathered on rank 0.
"""

from __future__ import annotations

import torch

from engine.layers.linear import CheckpointSlice, Linear, MergedLinear, VocabEmbedding
from engine.parallel_state import TensorParallel, current_tensor_parallel, shard_units


def _slice(tp: TensorParallel, dim: int, start: int, size: int) -> CheckpointSlice | None:
    return None if tp.size == 1 else CheckpointSlice(dim, start, size)


def _gathered_logits(tp: TensorParallel, local: torch.Tensor) -> torch.Tensor | None:
    """Rank 0: the logits of every rank's vocabulary rows side by side; other ranks: None."""
    return local if tp.comm is None else tp.comm.gather(local)


class MergedColumnParallelLinear(MergedLinear):
    """``shard_sizes`` (whole, as in the checkpoint) split by rank in ``units`` units each (default: one unit
    per row)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 units: dict[str, int] | None = None) -> None:
        tp = current_tensor_parallel()
        local, self._rows = {}, {}
        for name, size in shard_sizes.items():
            num_units = (units or {}).get(name, size)
            shard, unit = shard_units(num_units, tp, f"{name} units"), size // num_units
            local[name] = shard.count * unit
            self._rows[name] = (shard.start * unit, shard.count * unit)
        super().__init__(in_features, local, bias)
        self.tp = tp

    def checkpoint_slice(self, shard: str | None) -> CheckpointSlice | None:
        """This rank's rows of checkpoint tensor ``shard``; ``None``: the checkpoint stores the shards fused in
        one tensor (Phi-3), which is read whole on one rank only."""
        if shard is None:
            if self.tp.size > 1:
                raise ValueError("a fused checkpoint tensor does not split across tensor-parallel ranks")
            return None
        return _slice(self.tp, 0, *self._rows[shard])


class RowParallelLinear(Linear):
    """``in_features`` (whole) split by rank in ``units`` units (default: one per feature)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, units: int | None = None) -> None:
        tp = current_tensor_parallel()
        shard = shard_units(units or in_features, tp, "input units")
        unit = in_features // (units or in_features)
        super().__init__(shard.count * unit, out_features, bias)
        self.tp = tp
        self._columns = (shard.start * unit, shard.count * unit)

    def checkpoint_slice(self, shard: str | None) -> CheckpointSlice | None:
        return _slice(self.tp, 1, *self._columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.comm is None:
            return self.matmul(x, self.bias)
        # NOTE: the bias joins one rank's partial sum, so the all-reduce adds it once.
        return self.tp.comm.all_reduce(self.matmul(x, self.bias if self.tp.is_first else None))


class VocabParallelEmbedding(VocabEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        tp = current_tensor_parallel()
        shard = shard_units(vocab_size, tp, "vocabulary rows")
        super().__init__(shard.count, hidden_size)
        self.tp, self.vocab_start = tp, shard.start

    def checkpoint_slice(self, shard: str | None) -> CheckpointSlice | None:
        return _slice(self.tp, 0, self.vocab_start, self.out_features)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.comm is None:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.out_features)  # ids another rank holds
        rows = super().forward(local.masked_fill(elsewhere, 0))
        return self.tp.comm.all_reduce(rows.masked_fill(elsewhere.unsqueeze(1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden] -> [N, vocab]`` on rank 0 (None on the others): the tied output head."""
        return _gathered_logits(self.tp, Linear.forward(self, hidden))


class ParallelLMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        tp = current_tensor_parallel()
        shard = shard_units(vocab_size, tp, "vocabulary rows")
        super().__init__(hidden_size, shard.count)
        self.tp, self._rows = tp, shard

    def checkpoint_slice(self, shard: str | None) -> CheckpointSlice | None:
        return _slice(self.tp, 0, *self._rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden] -> [N, vocab]`` on rank 0 (None on the others)."""
        return _gathered_logits(self.tp, self.forward(hidden))
