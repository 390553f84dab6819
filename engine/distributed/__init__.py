"""Tensor parallelism on ``torch.distributed``: one scheduler, ranks that run the same step on their shards.

- ``parallel_state``: which rank a model is built for (``TensorParallel``), how a dimension splits by rank.
- ``communicator``: the collectives the parallel layers call (all-reduce, gather to rank 0), gloo or NCCL.
- ``workers``: the driver's ``WorkerGroup`` (one spawned process per rank > 0, each step's ``SchedulerOutput``
  sent to all) and the rank workers' loop.
- ``runner``: ``TensorParallelRunner``, rank 0's model runner: its own shard plus the group.
"""
