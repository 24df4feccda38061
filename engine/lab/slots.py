"""One decode at a time per process: on 2 CPU cores two decodes each run at a tenth of the speed,
and on one GPU they measure each other. Live decode, comparisons and every run of a background
sweep take the slot; whoever finds it taken waits and can say so ("busy: …")."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

_LOCK = threading.Lock()
_HOLDER: list[str] = [""]  # what holds the slot now, for the "busy" line


def holder() -> str:
    """What holds the decode slot now ('' when it is free)."""
    return _HOLDER[0]


@contextlib.contextmanager
def decode_slot(who: str, on_wait: Callable[[str], None] = lambda busy: None,
                wait_s: float | None = None, poll_s: float = 0.1) -> Iterator[None]:
    """Hold the process's decode slot for the block. While another holds it, `on_wait(holder)`
    is called once and this waits (at most `wait_s`; None waits for good, then TimeoutError)."""
    if not _LOCK.acquire(blocking=False):
        on_wait(holder() or "another decode")
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not _LOCK.acquire(timeout=poll_s):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"busy: {holder() or 'another decode'} holds the model; try again when it ends")
    _HOLDER[0] = who
    try:
        yield
    finally:
        _HOLDER[0] = ""
        _LOCK.release()
