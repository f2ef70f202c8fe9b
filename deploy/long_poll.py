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

``ObjectArrivals`` does the same for pulls of one object by its id. Flower stores a message
before its objects (the arrays): the ServerApp pushes a round's messages, then their objects;
a SuperNode pulls a message, then its objects; a ClientApp takes its task as soon as the node
created it, while the node is still pulling the objects. A pull that comes too early is told
"not available yet" and the puller backs off a whole second (then 2, 4, ...), so a message
crossed up to three such waits on its way to the ClientApp and its reply one more on its way
back. With ``ObjectArrivals`` such a pull waits until the object is stored (or ``wait``
seconds), and only the pulls of that object are woken.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flower_pin import require_flower

# wait_for_objects wraps Flower's object stores: on another Flower release, a clear refusal.
require_flower("deploy/long_poll.py")

Handler = TypeVar("Handler", bound=Callable[..., Any])
MAX_WAIT = 25.0  # seconds; the pollers' HTTP clients give up after 30


def _check_wait(wait: float) -> None:
    if not 0 <= wait <= MAX_WAIT:
        raise ValueError(f"a long poll waits 0 to {MAX_WAIT:g} s (clients time out at 30 s), got {wait}")


class LongPoll:
    """Wakes waiting poll handlers whenever a wrapped producer stored something."""

    def __init__(self, wait: float, max_waiting: int = 256) -> None:
        _check_wait(wait)
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


@dataclass
class _Waiters:
    """The requests waiting for one object: woken together by its arrival."""

    arrived: threading.Event = field(default_factory=threading.Event)
    count: int = 0


class ObjectArrivals:
    """Wakes the pulls waiting for an object when that object is stored."""

    def __init__(self, wait: float, max_waiting: int = 256) -> None:
        _check_wait(wait)
        self.wait, self.max_waiting = wait, max_waiting
        self._lock = threading.Lock()
        self._waiters: dict[str, _Waiters] = {}
        self._waiting = 0

    def producer(self, put: Handler) -> Handler:
        """An object store's ``put(self, object_id, content)`` that wakes the pulls of that
        object once it is stored."""
        @functools.wraps(put)
        def wrapped(store: Any, object_id: str, *args: Any, **kwargs: Any) -> Any:
            result = put(store, object_id, *args, **kwargs)
            with self._lock:
                waiters = self._waiters.pop(object_id, None)
            if waiters is not None:
                waiters.arrived.set()
            return result

        return wrapped  # type: ignore[return-value]

    def handler(self, pull: Handler, answered: Callable[[Any], bool]) -> Handler:
        """A ``pull_object`` handler (its request first, or as ``request=``) that, while its
        answer is "not available yet" (``answered`` false), waits for the object and asks again,
        until ``wait`` seconds have passed."""
        @functools.wraps(pull)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            response = pull(*args, **kwargs)
            if answered(response) or self.wait == 0:
                return response
            object_id = str((kwargs["request"] if "request" in kwargs else args[0]).object_id)
            deadline = time.monotonic() + self.wait
            while (waiters := self._enter(object_id)) is not None:
                try:
                    response = pull(*args, **kwargs)  # asked after entering: a store in between is seen
                    if answered(response) or (left := deadline - time.monotonic()) <= 0:
                        return response
                    waiters.arrived.wait(left)
                finally:
                    self._leave(object_id, waiters)
            return pull(*args, **kwargs)  # too many waiting: answered at once, as without waiting

        return wrapped  # type: ignore[return-value]

    def _enter(self, object_id: str) -> _Waiters | None:
        with self._lock:
            if self._waiting >= self.max_waiting:
                return None
            self._waiting += 1
            waiters = self._waiters.setdefault(object_id, _Waiters())
            waiters.count += 1
            return waiters

    def _leave(self, object_id: str, waiters: _Waiters) -> None:
        with self._lock:
            self._waiting -= 1
            waiters.count -= 1
            if waiters.count == 0 and self._waiters.get(object_id) is waiters:
                del self._waiters[object_id]


def object_answered(response: Any) -> bool:
    """Whether a ``PullObjectResponse`` is final: the object, or "no such object" (only an
    object announced but not yet stored is worth waiting for)."""
    return bool(response.object_available or not response.object_found)


def wait_for_objects(wait: float, pulls: list[tuple[Any, str]]) -> ObjectArrivals:
    """Make the ``pulls`` (owner, name of a ``pull_object`` handler) wait for objects announced
    but not yet stored, woken when Flower's object stores (in memory and SQLite) store them."""
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore  # noqa: PLC0415
    from flwr.supercore.object_store.sql_object_store import SqlObjectStore  # noqa: PLC0415

    arrivals = ObjectArrivals(wait)
    for store in (InMemoryObjectStore, SqlObjectStore):
        store.put = arrivals.producer(store.put)  # type: ignore[method-assign]
    for owner, name in pulls:
        setattr(owner, name, arrivals.handler(getattr(owner, name), object_answered))
    return arrivals


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
