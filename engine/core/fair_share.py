"""FairShare: the waiting queue, one heap per tenant, and each tenant's use of the token budget.

Within a priority level the token budget is shared between tenants by weight. Each tenant
has a ``usage``: the tokens computed for it (prefill chunks and decode tokens, as scheduled)
divided by its weight. The tenant with the least usage goes first, so a request from a
tenant that has used little runs before a burst from one that has used much.

A tenant is active while it has unfinished requests. One that becomes active starts at the
least usage of the active tenants (or, with none, at the usage the last one left with), so
idle time is no credit; an inactive tenant is forgotten.

Seats (``max_num_seqs``) are shared the same way: a waiting request may take the seat of a
running request of the same or a later priority when that request's tenant holds more seats
per weight than the waiting tenant would after the move (``victim_for``). The rule only ever
narrows the gap, so two tenants never trade seats back and forth.

Requests without a tenant form one tenant; with one tenant every order here is the plain
(priority, arrival) order.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.request import Request, RequestStatus

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(slots=True, eq=False)
class _Tenant:
    weight: float
    usage: float = 0.0  # tokens computed / weight
    num_unfinished: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_computed_tokens: int = 0  # tokens scheduled for it, unweighted, while active
    waiting: list[tuple[int, int, Request]] = field(default_factory=list)  # (priority, arrival, request); lazy deletes


class FairShare:
    """Owns the waiting queue (by tenant) and the per-tenant counters the scheduler's order reads.

    The scheduler reports every transition: ``add`` (a new unfinished request), ``push`` (it
    waits: new or preempted), ``pop`` (admitted from the top), ``run_stopped`` (left the
    running queue, preempted or finished), ``finish`` and ``charge`` (tokens scheduled).
    """

    def __init__(self) -> None:
        self._tenants: dict[str | None, _Tenant] = {}
        self._floor = 0.0  # the usage a tenant starts at when none is active
        # NOTE: tokens computed for tenants no longer active; with the active ones' counts
        # these make a monotonic total per tenant (``computed_tokens``).
        self._retired_tokens: dict[str | None, int] = {}
        self.num_waiting = 0

    # ------------------------------------------------------------------------ transitions

    def add(self, request: Request) -> None:
        """A new unfinished request; its tenant becomes active if it was not."""
        tenant = self._tenants.get(request.tenant)
        if tenant is None:
            active = [t.usage for t in self._tenants.values()]
            tenant = _Tenant(request.weight, usage=min(active) if active else self._floor)
            self._tenants[request.tenant] = tenant
        tenant.weight = request.weight
        tenant.num_unfinished += 1

    def push(self, request: Request) -> None:
        """``request`` waits (new, or preempted: it keeps its arrival, so it goes back to its place)."""
        tenant = self._tenants[request.tenant]
        heapq.heappush(tenant.waiting, (request.priority, request.arrival_seq, request))
        tenant.num_waiting += 1
        self.num_waiting += 1
        if len(tenant.waiting) > 2 * tenant.num_waiting + 64:
            tenant.waiting = [e for e in tenant.waiting if e[2].status in _QUEUED]
            heapq.heapify(tenant.waiting)

    def peek(self) -> Request | None:
        """The waiting request to admit next: best priority, then least usage, then fewest seats per weight, then arrival."""
        best: tuple[int, float, float, int] | None = None
        found = None
        for tenant in self._tenants.values():
            if not tenant.num_waiting:
                continue
            waiting = tenant.waiting
            while waiting[0][2].status not in _QUEUED:
                heapq.heappop(waiting)
            priority, arrival, request = waiting[0]
            key = (priority, tenant.usage, tenant.num_running / tenant.weight, arrival)
            if best is None or key < best:
                best, found = key, request
        return found

    def pop(self, request: Request) -> None:
        """``request``, the last ``peek()``, starts running."""
        tenant = self._tenants[request.tenant]
        entry = heapq.heappop(tenant.waiting)
        assert entry[2] is request
        tenant.num_waiting -= 1
        tenant.num_running += 1
        self.num_waiting -= 1

    def run_stopped(self, request: Request) -> None:
        """``request`` left the running queue (preempted or finished)."""
        self._tenants[request.tenant].num_running -= 1

    def finish(self, request: Request, was_queued: bool) -> None:
        """``request`` finished; ``was_queued``: it was waiting (its heap entry is dropped lazily)."""
        tenant = self._tenants[request.tenant]
        if was_queued:
            tenant.num_waiting -= 1
            self.num_waiting -= 1
        tenant.num_unfinished -= 1
        if not tenant.num_unfinished:
            # NOTE: the next tenant to arrive alone starts here, not at zero: idle time is no credit.
            self._floor = max(self._floor, tenant.usage)
            retired = self._retired_tokens
            retired[request.tenant] = retired.get(request.tenant, 0) + tenant.num_computed_tokens
            del self._tenants[request.tenant]

    def charge(self, scheduled: Iterable[tuple[Request, int]]) -> None:
        """Adds each request's scheduled tokens to its tenant's usage."""
        tenants = self._tenants
        for request, num_tokens in scheduled:
            tenant = tenants[request.tenant]
            tenant.usage += num_tokens / tenant.weight
            tenant.num_computed_tokens += num_tokens

    # ------------------------------------------------------------------------ reads

    def order(self, request: Request) -> tuple[int, float, int]:
        """The running queue's sort key: priority, then the tenant's usage, then arrival."""
        return (request.priority, self._tenants[request.tenant].usage, request.arrival_seq)

    def victim_for(self, request: Request, running: Sequence[Request]) -> Request | None:
        """A running request whose seat ``request`` may take for fairness, or None.

        The victim has the same or a later priority and belongs to the tenant with the most
        seats per weight, which must exceed the seats per weight ``request``'s tenant would
        hold with one more; of its requests, the latest in ``running`` order.
        """
        mine = self._tenants[request.tenant]
        after = (mine.num_running + 1) / mine.weight
        latest: dict[int, Request] = {}  # id(tenant) -> its latest eligible running request
        for candidate in reversed(running):
            tenant = self._tenants[candidate.tenant]
            if candidate.priority >= request.priority and tenant is not mine and id(tenant) not in latest:
                if tenant.num_running / tenant.weight > after:
                    latest[id(tenant)] = candidate
        if not latest:
            return None
        return max(latest.values(), key=lambda r: self._seats_per_weight(r.tenant))

    def _seats_per_weight(self, tenant: str | None) -> float:
        found = self._tenants[tenant]
        return found.num_running / found.weight

    def usage(self, tenant: str | None) -> float | None:
        """A tenant's usage (tokens per weight); None when it is not active."""
        found = self._tenants.get(tenant)
        return None if found is None else found.usage

    def tenant_requests(self) -> dict[str | None, tuple[int, int]]:
        """Each active tenant's ``(num_running, num_waiting)``."""
        return {name: (t.num_running, t.num_waiting) for name, t in self._tenants.items()}

    def computed_tokens(self) -> dict[str | None, int]:
        """Tokens scheduled for each tenant seen so far (prefill chunks and decode tokens); only grows."""
        totals = dict(self._retired_tokens)
        for name, tenant in self._tenants.items():
            totals[name] = totals.get(name, 0) + tenant.num_computed_tokens
        return totals
