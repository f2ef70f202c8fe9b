"""Long polling for Flower's poll-based APIs: an empty answer waits until there may be news.

A SuperNode asks its SuperLink for messages, and a ClientApp executor asks its SuperNode for
tasks, by polling: each empty answer costs a full authenticated request on both sides, and the
news waits for the next poll. Twenty SuperNodes with their executors on one host, polling twice
and ten times a second, kept about 1.2 of its 2 cores busy while the federation was idle.

``LongPoll`` makes such a server answer an empty poll only when something new was stored or
after ``wait`` seconds: the producer (the method that stores a message or a task) is wrapped to
wake the waiting handlers, and each woken handler runs the original handler again. The poller
is unchanged (a stock client just sees slower empty answers), idle traffic drops to one request
per ``wait`` seconds, and news is delivered as soon as it is stored instead of at the next
poll. At most ``max_waiting`` requests wait at once (each holds a server thread); beyond that a
poll is answered at once, as without long polling.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

Handler = TypeVar("Handler", bound=Callable[..., Any])
MAX_WAIT = 25.0  # seconds; the pollers' HTTP clients give up after 30


class LongPoll:
    """Wakes waiting poll handlers whenever a wrapped producer stored something."""

    def __init__(self, wait: float, max_waiting: int = 256) -> None:
        if not 0 <= wait <= MAX_WAIT:
            raise ValueError(f"a long poll waits 0 to {MAX_WAIT:g} s (clients time out at 30 s), got {wait}")
        self.wait, self.max_waiting = wait, max_waiting
        self._condition = threading.Condition()
        self._stored = 0  # how many times a producer stored something
        self._waiting = 0

    def producer(self, store: Handler) -> Handler:
        """``store`` that wakes the waiting handlers after it stored something."""
        @functools.wraps(store)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = store(*args, **kwargs)
            with self._condition:
                self._stored += 1
                self._condition.notify_all()
            return result

        return wrapped  # type: ignore[return-value]

    def handler(self, handle: Handler, answered: Callable[[Any], bool]) -> Handler:
        """``handle`` that, while its answer is empty (``answered`` false), waits for a producer
        and asks again, until ``wait`` seconds have passed."""
        @functools.wraps(handle)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            deadline = time.monotonic() + self.wait
            seen = self._stored  # read before asking: a store during the ask is not missed
            response = handle(*args, **kwargs)
            if answered(response) or not self._enter():
                return response
            try:
                while not answered(response) and (left := deadline - time.monotonic()) > 0:
                    with self._condition:
                        self._condition.wait_for(lambda last=seen: self._stored != last, timeout=left)
                        seen = self._stored
                    response = handle(*args, **kwargs)
                return response
            finally:
                with self._condition:
                    self._waiting -= 1

        return wrapped  # type: ignore[return-value]

    def _enter(self) -> bool:
        with self._condition:
            if self._waiting >= self.max_waiting or self.wait == 0:
                return False
            self._waiting += 1
            return True


def wait_from_environment(variable: str, default: float) -> float:
    """The long-poll wait configured in ``variable`` (seconds, 0 turns long polling off)."""
    raw = os.environ.get(variable, str(default))
    try:
        wait = float(raw)
    except ValueError:
        wait = -1.0
    if not 0 <= wait <= MAX_WAIT:
        raise SystemExit(f"{variable} must be a number of seconds from 0 (off) to {MAX_WAIT:g}, got {raw!r}")
    return wait
