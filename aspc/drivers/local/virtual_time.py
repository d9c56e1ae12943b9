"""Time and queues for the local driver's threads: real (the default) or virtual.

Virtual time makes a run of the threaded driver deterministic, for the differential test that
holds it to the simulator: exactly one participating thread runs at a time (it holds the baton),
a blocking queue read or a `sleep` passes the baton on, and the clock jumps to the next timer
only when every participant waits. Ties are broken in a fixed order (threads made ready first
run first), so a run does not depend on the machine's speed or load.
"""
from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections import deque


class RealTime:
    """What the local and Ray drivers use by default: the wall clock and thread-safe queues."""

    virtual = False

    def __init__(self):
        self.origin = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.origin

    def reset(self) -> None:
        self.origin = time.perf_counter()

    def queue(self) -> queue.Queue:
        return queue.Queue()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def expect(self, name: str) -> None:
        """A thread of that name will take part (a no-op in real time)."""

    def leave(self) -> None:
        """The calling thread takes no further part."""


class Deadlock(RuntimeError):
    """Every participant waits on an empty queue and no timer is set: the run cannot go on."""


class VirtualTime:
    virtual = True

    def __init__(self):
        self.now = 0.0
        self._cond = threading.Condition()
        self._holder: str | None = threading.current_thread().name  # the thread that makes it holds the baton
        self._expected: set[str] = set()  # started threads that have not yet asked for the baton
        self._ready: deque[str] = deque()
        self._settling: deque[str] = deque()
        self._timers: list[tuple[float, int, str, int]] = []  # (time, order, thread, wake token)
        self._token: dict[str, int] = {}  # thread -> the token that may wake it now
        self._order = itertools.count()
        self._members: set[str] = {self._holder}  # threads taking part and not yet gone
        self._deadlock = False

    def __call__(self) -> float:
        return self.now

    def reset(self) -> None:
        """The clock keeps its origin: virtual time starts at 0 and never runs between runs."""

    def queue(self) -> VirtualQueue:
        return VirtualQueue(self)

    def expect(self, name: str) -> None:
        """A thread of that name is about to start and take part: nothing runs until it arrives."""
        with self._cond:
            self._expected.add(name)
            self._members.add(name)

    # ---- what a participating thread calls ----
    def sleep(self, seconds: float) -> None:
        with self._cond:
            me = self._enter()
            self._timer(self.now + max(seconds, 0.0), me)
            self._wait(me)

    def settle(self) -> None:
        """Let every thread that can run at this instant run first (a poll sees what they post)."""
        with self._cond:
            me = self._enter()
            self._settling.append(me)
            self._wait(me)

    def leave(self) -> None:
        with self._cond:
            me = threading.current_thread().name
            self._expected.discard(me)
            self._members.discard(me)
            if self._holder == me:
                self._holder = None
            self._schedule()

    # ---- the baton (all under self._cond) ----
    def _enter(self) -> str:
        """The calling thread, holding the baton (a newly started thread first waits for it)."""
        me = threading.current_thread().name
        if me in self._expected:
            self._expected.discard(me)
            self._ready.append(me)
            self._schedule()
            self._wait_for_baton(me)
        assert self._holder == me, f"thread {me} runs without the baton"
        return me

    def _timer(self, at: float, me: str) -> None:
        token = next(self._order)
        self._token[me] = token
        heapq.heappush(self._timers, (at, token, me, token))

    def _wait(self, me: str) -> None:
        self._holder = None
        self._schedule()
        self._wait_for_baton(me)

    def _wait_for_baton(self, me: str) -> None:
        while self._holder != me:
            if self._deadlock:
                raise Deadlock(f"virtual time {self.now:.3f}: every thread waits and no timer is set")
            self._cond.wait()
        self._token.pop(me, None)

    def _wake(self, name: str) -> None:
        """A queue got an item for a thread blocked on it."""
        self._token.pop(name, None)  # its timeout, if any, no longer wakes it
        self._ready.append(name)
        self._schedule()

    def _schedule(self) -> None:
        if self._holder is not None or self._expected:
            return  # someone runs, or a started thread has not arrived yet
        self._drop_stale_timers()
        if self._ready:
            self._give(self._ready.popleft())
        elif self._timers and self._timers[0][0] <= self.now:
            self._give(heapq.heappop(self._timers)[2])
        elif self._settling:
            self._give(self._settling.popleft())
        elif self._timers:
            at, _, name, _ = heapq.heappop(self._timers)
            self.now = at
            self._give(name)
        elif self._members:
            self._deadlock = True
            self._cond.notify_all()

    def _drop_stale_timers(self) -> None:
        while self._timers and self._token.get(self._timers[0][2]) != self._timers[0][3]:
            heapq.heappop(self._timers)

    def _give(self, name: str) -> None:
        self._holder = name
        self._cond.notify_all()


class VirtualQueue:
    """A FIFO queue whose blocking reads pass the baton; `get_nowait` settles the instant first."""

    def __init__(self, time_: VirtualTime):
        self.time = time_
        self.items: deque = deque()
        self.waiter: str | None = None

    def put(self, item) -> None:
        with self.time._cond:
            self.items.append(item)
            if self.waiter is not None:
                waiter, self.waiter = self.waiter, None
                self.time._wake(waiter)

    def get(self, block: bool = True, timeout: float | None = None):
        if not block:
            return self.get_nowait()
        t = self.time
        with t._cond:
            me = t._enter()
            if self.items:
                return self.items.popleft()
            self.waiter = me
            if timeout is not None:
                t._timer(t.now + timeout, me)
            t._wait(me)
            if self.waiter == me:
                self.waiter = None
            if not self.items:
                raise queue.Empty
            return self.items.popleft()

    def get_nowait(self):
        self.time.settle()
        with self.time._cond:
            if not self.items:
                raise queue.Empty
            return self.items.popleft()

    def put_nowait(self, item) -> None:
        self.put(item)

    def empty(self) -> bool:
        return not self.items
