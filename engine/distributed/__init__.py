"""Tensor and pipeline parallelism on ``torch.distributed``: one scheduler, ranks that run the same step on their
shards (a share of a stage's heads, a stage's layers).

- ``communicator``: a group's collectives (all-reduce, gather to rank 0, send and receive), gloo or NCCL, which
  the parallel layers call through ``engine.parallel_state.TensorParallel`` (the rank a model is built for).
- ``pipeline``: the rank layout of stages, and ``PipelineLinks`` (hidden states to the next stage, logits to the
  driver) through ``engine.parallel_state.PipelineStage``.
- ``workers``: the driver's ``WorkerGroup`` (one spawned process per rank > 0, each step's ``SchedulerOutput``
  sent to all) and the rank workers' loop.
- ``ray_workers``: ``RayWorkerGroup``, the same group as Ray actors in one placement group, across nodes.
- ``rank_calls``: ``RankCall``, the driver's calls on the ranks' runners between steps: persisted KV blocks
  (``kv_cache_dir``) in and out of every rank's shard, each stage's idle time.
- ``runner``: ``ParallelRunner``, rank 0's model runner: its own shard plus the group; under a pipeline, steps
  sent into the pipe (``submit``) and their logits taken in order (``collect``), several in flight at once.
"""
