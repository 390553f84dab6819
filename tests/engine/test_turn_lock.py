"""engine.driver.TurnLock: the step lock engines of one process share hands turns over in arrival order."""

from __future__ import annotations

import threading
import time

from engine.driver import TurnLock


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_driver_that_just_stepped_queues_behind_one_that_waits() -> None:
    lock = TurnLock()
    order: list[str] = []

    def waiter() -> None:
        with lock:
            order.append("waiter")

    lock.__enter__()  # the stepping driver holds its turn
    thread = threading.Thread(target=waiter)
    thread.start()
    _wait_for(lambda: lock._issued == 2)  # the waiter has taken its ticket
    lock.__exit__(None, None, None)
    with lock:  # the driver that just stepped asks again at once: the waiter goes first
        order.append("stepper")
    thread.join(10)
    assert order == ["waiter", "stepper"]


def test_steps_never_overlap() -> None:
    lock = TurnLock()
    inside, most = [0], [0]
    guard = threading.Lock()

    def step(n: int) -> None:
        for _ in range(n):
            with lock:
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=step, args=(200,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == 1 and lock._serving == lock._issued == 800
