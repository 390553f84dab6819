"""``PrefixAffinityRouter``: a Ray Serve request router that sends a request where its prefix is cached.

Each request to the engine deployment carries ``prefix``, the block hashes of its prompt's first
blocks (``integrations.ray.prefix``). A replica holds a prefix up to block ``i`` when block ``i``'s
hash is among

- the hashes the replica reported as still cached in its engine (``record_routing_stats``,
  refreshed every ``request_routing_stats_period_s``), or
- the hashes of requests this router sent it recently (its own memory, which covers the seconds
  before the next report and prefixes under a tenant's cache salt).

Hashes chain over their parents, so the deepest held hash gives the length of the match. The router
ranks the replica with the longest match first, unless it runs more than ``max_imbalance`` requests
beyond the least-loaded one: then one hot prefix would pin the load on one replica, and the request
goes to the least-loaded replica instead, which from then on holds that prefix too. With no match,
the least-loaded replica takes it. The others form the second rank: Ray Serve tries them when the
first replica's queue is full.

A request with ``replica`` (a replica id from ``router_registry.replica_ids``) goes to that replica alone: the
ingress reads every replica's ``/metrics`` that way.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from integrations.ray import router_registry

PREFIX_KWARG = "prefix"  # the keyword argument that carries a request's block hashes
REPLICA_KWARG = "replica"  # the keyword argument that names the one replica a request must go to
STATS_PREFIXES = "prefix_hashes"  # routing stats: hashes the replica's engine still caches
STATS_QUEUE = "num_requests"  # routing stats: the engine's running + waiting requests

DEFAULT_MAX_IMBALANCE = 8  # requests beyond the least-loaded replica before affinity yields
DEFAULT_MEMORY_SIZE = 4096  # hashes remembered per replica (LRU)


class PrefixAffinityRouter(RequestRouter):
    """Ranks replicas by the prefix blocks they hold, balanced against their queue length.

    Routing kwargs (``RequestRouterConfig.request_router_kwargs``): ``max_imbalance`` and
    ``memory_size`` (see the module docstring).
    """

    def initialize_state(
        self, max_imbalance: int = DEFAULT_MAX_IMBALANCE, memory_size: int = DEFAULT_MEMORY_SIZE, **_: Any
    ) -> None:
        if max_imbalance < 0 or memory_size < 1:
            raise ValueError(f"max_imbalance must be >= 0 and memory_size >= 1, got {max_imbalance}, {memory_size}")
        self.max_imbalance = max_imbalance
        self.memory_size = memory_size
        self._memory: dict[ReplicaID, OrderedDict[bytes, None]] = {}
        # NOTE: Serve builds a handle's router in the caller's process: the ingress finds it there.
        router_registry.register(self._deployment_id.app_name, self._deployment_id.name, self)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # NOTE: without it Serve retries at once, in a tight loop, while every queue is full.
            pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get(REPLICA_KWARG) if pending_request is not None else None
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        hashes = _prefix(pending_request)
        if not hashes or len(candidate_replicas) < 2:
            return [candidate_replicas]
        loads = {r.replica_id: self._load(r) for r in candidate_replicas}
        # NOTE: ties go to a random replica, so an idle fleet does not start every prefix on one.
        least = min(candidate_replicas, key=lambda r: (loads[r.replica_id], random.random()))
        best = max(candidate_replicas, key=lambda r: (self.match_length(r, hashes), -loads[r.replica_id]))
        first = least
        if self.match_length(best, hashes) > 0 and loads[best.replica_id] - loads[least.replica_id] <= self.max_imbalance:
            first = best
        # NOTE: remembered now, not only once routed: Serve reports a routed request after the
        # replica accepted it, and requests with the same prefix routed meanwhile must follow it.
        self._remember(first.replica_id, hashes)
        return [[first], [r for r in candidate_replicas if r is not first]]

    def match_length(self, replica: RunningReplica, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the replica holds (reported or routed there)."""
        reported = (replica.routing_stats or {}).get(STATS_PREFIXES) or ()
        memory = self._memory.get(replica.replica_id, {})
        for depth in range(len(hashes), 0, -1):
            digest = hashes[depth - 1]
            if digest in memory or digest in reported:
                return depth
        return 0

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._remember(replica_id, _prefix(pending_request))  # the replica Serve chose, if not the first rank

    def _remember(self, replica_id: ReplicaID, hashes: Sequence[bytes]) -> None:
        memory = self._memory.setdefault(replica_id, OrderedDict())
        for digest in hashes:
            memory[digest] = None
            memory.move_to_end(digest)
        while len(memory) > self.memory_size:
            memory.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._memory.pop(replica_id, None)  # its successor starts with an empty cache

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for replica_id in [r for r in self._memory if r not in live]:
            del self._memory[replica_id]

    def _load(self, replica: RunningReplica) -> int:
        """Requests on the replica: Serve's queue-length cache, else the replica's last report."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is not None:
            return queue_len
        return int((replica.routing_stats or {}).get(STATS_QUEUE, 0))


def _prefix(pending_request: PendingRequest | None) -> Sequence[bytes]:
    if pending_request is None:
        return ()
    return pending_request.kwargs.get(PREFIX_KWARG) or ()
