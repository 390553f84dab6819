"""RateLimiter: holds one tenant to its policy's requests per minute, tokens per minute and concurrency.

Each per-minute limit is a token bucket that holds a minute's allowance and refills it
evenly over the minute, as OpenAI's limits behave: a tenant may spend its whole minute at
once, then waits for the refill. A request is admitted in two steps, so a flood is refused
before any prompt is rendered:

1. ``enter()`` before the hooks: a concurrency slot and one request from the bucket.
2. ``Lease.take_tokens(n)`` once the prompt is tokenized: its tokens plus ``max_tokens``
   (times ``n``). A request refused here gets its request back.

``Lease.release(used)`` ends the request: its slot comes back, and so do the tokens it
reserved but did not use. Refusals raise ``RateLimited`` with the seconds to wait.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from sdk.errors import InvalidRequestError, RateLimited
from sdk.policy import TenantPolicy
from sdk.quota import Quota, RateLimitState


class _Bucket:
    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # per second
        self.level = self.capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float) -> bool:
        if self.level < amount:
            return False
        self.level -= amount
        return True

    def give(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` is available."""
        return max(0.0, (amount - self.level) / self.rate)

    def quota(self) -> Quota:
        return Quota(int(self.capacity), int(self.level), (self.capacity - self.level) / self.rate)


class RateLimiter:
    """The rate state of one tenant (thread-safe).

    Args:
        policy: its ``requests_per_minute``, ``tokens_per_minute`` and ``max_concurrent_requests``.
        clock: monotonic seconds; tests may pass a clock of their own.
    """

    def __init__(self, policy: TenantPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        now = clock()
        self._requests = _Bucket(policy.requests_per_minute, now) if policy.requests_per_minute else None
        self._tokens = _Bucket(policy.tokens_per_minute, now) if policy.tokens_per_minute else None
        self._max_in_flight = policy.max_concurrent_requests
        self._lock = threading.Lock()
        self.num_in_flight = 0

    def enter(self) -> Lease:
        """Admit one request: a concurrency slot and one request from the bucket.

        Raises:
            RateLimited: no slot is free, or the minute's requests are spent.
        """
        with self._lock:
            if self._max_in_flight is not None and self.num_in_flight >= self._max_in_flight:
                raise RateLimited(
                    f"{self.num_in_flight} requests in flight; max_concurrent_requests is {self._max_in_flight}",
                    retry_after=1.0, state=self._state(),
                )  # fmt: skip
            bucket = self._requests
            if bucket is not None:
                bucket.refill(self.clock())
                if not bucket.take(1):
                    raise RateLimited(
                        f"requests_per_minute ({int(bucket.capacity)}) reached",
                        retry_after=bucket.wait(1), state=self._state(),
                    )  # fmt: skip
            self.num_in_flight += 1
        return Lease(self)

    def state(self) -> RateLimitState:
        """The quotas now, for the ``x-ratelimit-*`` headers."""
        with self._lock:
            now = self.clock()
            for bucket in (self._requests, self._tokens):
                if bucket is not None:
                    bucket.refill(now)
            return self._state()

    def _state(self) -> RateLimitState:
        return RateLimitState(
            self._requests.quota() if self._requests is not None else None,
            self._tokens.quota() if self._tokens is not None else None,
        )


class Lease:
    """One admitted request's hold on its limiter; ``release()`` exactly once."""

    def __init__(self, limiter: RateLimiter) -> None:
        self._limiter = limiter
        self.num_tokens = 0  # reserved from the token bucket
        self._released = False

    def take_tokens(self, num_tokens: int) -> None:
        """Reserve the request's tokens (prompt plus what it may generate).

        Raises:
            InvalidRequestError: more than the whole minute's tokens (it could never run).
            RateLimited: not enough tokens left this minute.

        Either way the request is given back to the requests bucket.
        """
        limiter = self._limiter
        bucket = limiter._tokens
        if bucket is None:
            return
        if num_tokens > bucket.capacity:
            with limiter._lock:
                if limiter._requests is not None:
                    limiter._requests.give(1)
            raise InvalidRequestError(
                f"max_tokens: the request needs {num_tokens} tokens (prompt plus max_tokens); "
                f"tokens_per_minute is {int(bucket.capacity)}",
                param="max_tokens",
            )
        with limiter._lock:
            bucket.refill(limiter.clock())
            if not bucket.take(num_tokens):
                if limiter._requests is not None:
                    limiter._requests.give(1)
                raise RateLimited(
                    f"tokens_per_minute ({int(bucket.capacity)}) reached: {math.floor(bucket.level)} left, "
                    f"{num_tokens} needed", retry_after=bucket.wait(num_tokens), state=limiter._state(),
                )  # fmt: skip
            self.num_tokens = num_tokens

    def release(self, num_tokens_used: int) -> None:
        """End the request: its slot comes back, and the tokens it reserved beyond ``num_tokens_used``."""
        if self._released:
            return
        self._released = True
        limiter = self._limiter
        with limiter._lock:
            limiter.num_in_flight -= 1
            unused = self.num_tokens - num_tokens_used
            if limiter._tokens is not None and unused > 0:
                limiter._tokens.give(unused)
