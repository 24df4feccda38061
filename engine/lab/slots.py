"""One decode at a time per process: on 2 CPU cores two decodes each run at a tenth of the speed,
and on one GPU they measure each other. Live decode, comparisons and every run of a background
sweep take the slot; whoever finds it taken waits and can say so ("busy: …").

The slot is served first come, first served: with several sessions pressing Generate while a
sweep runs, a plain lock lets whichever waiter wakes first take it, so one session could wait
through any number of others' decodes. Here each waiter holds a ticket in a queue and takes the
slot when its ticket reaches the head: nobody waits behind more decodes than were queued before it."""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

_COND = threading.Condition()
_QUEUE: deque[object] = deque()  # tickets in arrival order; the head's owner holds the slot
_HOLDER: list[str] = [""]  # what holds the slot now, for the "busy" line


def holder() -> str:
    """What holds the decode slot now ('' when it is free)."""
    return _HOLDER[0]


def queued() -> int:
    """Decodes waiting for the slot now (not counting the one holding it)."""
    with _COND:
        return max(len(_QUEUE) - 1, 0)


@contextlib.contextmanager
def decode_slot(who: str, on_wait: Callable[[str], None] = lambda busy: None,
                wait_s: float | None = None, poll_s: float = 0.1) -> Iterator[None]:
    """Hold the process's decode slot for the block, in arrival order. While another holds it,
    `on_wait(holder)` is called once and this waits (at most `wait_s`; None waits for good, then
    TimeoutError, leaving the queue as if it had never come)."""
    ticket = object()
    with _COND:
        _QUEUE.append(ticket)
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
