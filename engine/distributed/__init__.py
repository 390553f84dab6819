"""Tensor parallelism on ``torch.distributed``: one scheduler, ranks that run the same step on their shards.

- ``communicator``: a group's collectives (all-reduce, gather to rank 0), gloo or NCCL, which the parallel
  layers call through ``engine.parallel_state.TensorParallel`` (the rank a model is built for).
- ``workers``: the driver's ``WorkerGroup`` (one spawned process per rank > 0, each step's ``SchedulerOutput``
  sent to all) and the rank workers' loop.
- ``runner``: ``TensorParallelRunner``, rank 0's model runner: its own shard plus the group.
"""
