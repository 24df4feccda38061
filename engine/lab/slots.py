"""One decode at a time per process: on 2 CPU cores two decodes each run at a tenth of the speed,
and on one GPU they measure each other. Live decode, comparisons and every run of a background
sweep take the slot; whoever finds it taken waits and can say so ("busy: …").

The slot is served first come, first served: with several sessions pressing Generate while a
sweep runs, a plain lock lets whichever waiter wakes first take it, so one session could wait
through any number of others' decodes. Here each waiter holds a ticket in a queue and takes the
slot when its ticket reaches the head: nobody waits behind more decodes than were queued before it.

A decode that streams its steps (a Live run, a comparison's runs) takes the slot for one step at a
time (`stepped`) and queues again for the next: decodes pressed together then advance in turns, a
step each, like a round-robin scheduler, and a session's first token waits for one step of each
decode ahead of it instead of for their whole runs. Each run's own wall time leaves out the turns
it waited (engine/lab/generation.py)."""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

_COND = threading.Condition()
_QUEUE: deque[object] = deque()  # tickets in arrival order; the head's owner holds the slot
_HOLDER: list[str] = [""]  # what holds the slot now, for the "busy" line
T = TypeVar("T")


def holder() -> str:
    """What holds the decode slot now ('' when it is free)."""
    return _HOLDER[0]


def queued() -> int:
    """Decodes waiting for the slot now (not counting the one holding it)."""
    with _COND:
        return max(len(_QUEUE) - 1, 0)


@contextlib.contextmanager
def decode_slot(who: str, on_wait: Callable[[str], None] = lambda busy: None,
                wait_s: float | None = None, poll_s: float = 0.1,
                on_queued: Callable[[float], None] = lambda at: None) -> Iterator[None]:
    """Hold the process's decode slot for the block, in arrival order. While another holds it,
    `on_wait(holder)` is called once and this waits (at most `wait_s`; None waits for good, then
    TimeoutError, leaving the queue as if it had never come). `on_queued(time.time())` hears when
    it joined the queue (stamped in the queue's order)."""
    ticket = object()
    with _COND:
        _QUEUE.append(ticket)
        on_queued(time.time())
        first = _QUEUE[0] is ticket
        busy = holder() or "another decode"
    if not first:
        on_wait(busy)  # outside the lock: a page's callback may take its time
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with _COND:
            while _QUEUE[0] is not ticket:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    _QUEUE.remove(ticket)
                    _COND.notify_all()
                    raise TimeoutError(f"busy: {holder() or 'another decode'} holds the model; try again when it ends")
                _COND.wait(poll_s if left is None else min(poll_s, left))
    _HOLDER[0] = who
    try:
        yield
    finally:
        with _COND:
            _HOLDER[0] = ""
            assert _QUEUE[0] is ticket, "the slot's holder is the queue's head"
            _QUEUE.popleft()
            _COND.notify_all()


def stepped(steps: Iterable[T], who: str, on_wait: Callable[[str], None] = lambda busy: None,
            waited: Callable[[float], None] = lambda ms: None,
            on_queued: Callable[[float], None] = lambda at: None) -> Iterator[T]:
    """`steps` iterated in turns with the other decodes: the slot is taken for each `next()` and
    given back before the item is handed on. `on_wait(holder)` and `on_queued(at)` as for the
    first step only (the later turns are short); `waited(ms)` hears how long each turn queued,
    once it has the slot. Closing this closes `steps` (a Generation stopped early keeps what it
    ran)."""
    it = iter(steps)
    try:
        first = True
        while True:
            t0 = time.monotonic()
            with decode_slot(who, on_wait if first else lambda busy: None,
                             on_queued=on_queued if first else lambda at: None):
                waited((time.monotonic() - t0) * 1e3)
                try:
                    item = next(it)
                except StopIteration:
                    return
            first = False
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
