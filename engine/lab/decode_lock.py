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
it waited (engine/lab/generation.py).

A session's action opens with a turn marked `opening` (a Live run's first, a comparison run's
first): it queues behind the openings already waiting but ahead of the later turns of decodes
already running, as a multilevel feedback queue lets a task that just woke run first. With eight
sessions and a sweep all decoding, a plain round robin makes a newcomer wait one turn of each,
and a few slow turns (a sweep's trace step while browsers load pages on the same cores) add up
to several of its own decodes; this way it waits for the turn in progress and the other
newcomers. Each decode opens once, so the running ones lose at most a turn per newcomer.
A sweep's turns never open: it is background work.

Between two turns, while the CPU is oversubscribed, a running decode gives way before it queues
again (engine/runtime/threads.give_way; GIVE_S): pages opened meanwhile are drawn first.

A turn can be long (a sweep's prefill of a real prompt, a trace step's drafts, any step while the
browsers take the cores), and an opening that queues behind it would wait for all of it. So once a
stepped turn has held the slot SLICE_S, it hands the slot over at the forward's next layer
(engine/runtime/preempt.py) to the openings waiting, queueing itself behind them and ahead of
the later turns, and resumes where it stopped: the same operations, the same outputs. A newcomer
then waits at most a slice of each decode ahead of it. Plain holds (`decode_slot`: cost tables,
probes) are never paused: they time what they run."""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from engine.runtime import preempt


class _Ticket:
    """A place in the queue; `opening`: a session's first turn (decode_slot)."""

    __slots__ = ("opening",)

    def __init__(self, opening: bool) -> None:
        self.opening = opening


_COND = threading.Condition()
# Tickets, openings first (each kind in arrival order) behind the head, whose owner holds the
# slot (or is waking up to take it, which is why nothing is ever put ahead of it).
_QUEUE: deque[_Ticket] = deque()
_HOLDER: list[str] = [""]  # what holds the slot now, for the "busy" line
T = TypeVar("T")
# How long a running decode gives way between two turns while the CPU is oversubscribed, at most:
# long enough for the pages opened meanwhile to be drawn (a burst of sessions' pages at once), and
# in all at most GIVE_CREDIT_S more than its own turns took, so it keeps half its speed however
# long the pressure lasts.
GIVE_S = 0.5
GIVE_CREDIT_S = 1.0
# A stepped turn runs this long before it hands the slot to the openings waiting behind it: a few
# target layers of a prefill on one busy core, short beside a live run (bench load's decode of a
# few hundred milliseconds), long beside a hand-over's cost (a wake-up).
SLICE_S = 0.1
_HELD = threading.local()  # .ticket, .since: this thread's stepped turn and when its slice began


def _join(ticket: _Ticket) -> None:
    """Queue `ticket`: at the end, or an opening ahead of the later turns waiting behind the head."""
    at = len(_QUEUE)
    if ticket.opening and _QUEUE:
        at = 1
        while at < len(_QUEUE) and _QUEUE[at].opening:
            at += 1
    _QUEUE.insert(at, ticket)


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
                on_queued: Callable[[float], None] = lambda at: None, opening: bool = False,
                sliced: bool = False) -> Iterator[None]:
    """Hold the process's decode slot for the block, in arrival order (an `opening`, a session's
    first turn, ahead of other decodes' later turns). While another holds it, `on_wait(holder)`
    is called once and this waits (at most `wait_s`; None waits for good, then TimeoutError,
    leaving the queue as if it had never come). `on_queued(time.time())` hears when it joined
    the queue (stamped in the queue's order). `sliced`: the block may be paused at a forward's
    layer for the openings waiting, once it has held the slot SLICE_S (`_hand_over`)."""
    ticket = _Ticket(opening)
    with _COND:
        _join(ticket)
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
    if sliced:
        _HELD.ticket, _HELD.since = ticket, time.monotonic()
    try:
        yield
    finally:
        with _COND:
            if sliced:  # a hand-over gave it a new ticket
                ticket, _HELD.ticket = _HELD.ticket, None
            _HOLDER[0] = ""
            assert _QUEUE[0] is ticket, "the slot's holder is the queue's head"
            _QUEUE.popleft()
            _COND.notify_all()


def _hand_over(poll_s: float = 0.1) -> float:
    """preempt's handler, at a layer of a forward: a sliced turn that has held the slot SLICE_S
    while an opening waits gives the slot to the queue, queued itself behind the openings (ahead of
    the later turns: it is in the middle of one), and waits for it back. Returns the ms it waited."""
    ticket = getattr(_HELD, "ticket", None)
    if ticket is None or len(_QUEUE) < 2 or time.monotonic() - _HELD.since < SLICE_S:
        return 0.0
    with _COND:
        if not any(t.opening for t in itertools.islice(_QUEUE, 1, None)):
            return 0.0
        assert _QUEUE[0] is ticket, "the slot's holder is the queue's head"
        t0, who = time.monotonic(), _HOLDER[0]
        _QUEUE.popleft()
        again = _Ticket(opening=True)
        _join(again)
        _HOLDER[0] = ""
        _COND.notify_all()
        while _QUEUE[0] is not again:
            _COND.wait(poll_s)
        _HOLDER[0] = who
        _HELD.ticket, _HELD.since = again, time.monotonic()
    return (_HELD.since - t0) * 1e3


preempt.install(_hand_over)


def stepped(steps: Iterable[T], who: str, on_wait: Callable[[str], None] = lambda busy: None,
            waited: Callable[[float], None] = lambda ms: None,
            on_queued: Callable[[float], None] = lambda at: None, opening: bool = False) -> Iterator[T]:
    """`steps` iterated in turns with the other decodes: the slot is taken for each `next()` and
    given back before the item is handed on. `on_wait(holder)`, `on_queued(at)` and `opening`
    as for the first step only; `waited(ms)` hears how long each turn queued, once it has the
    slot, and how long it was paused within the turn for others' openings, if it was. Closing this
    closes `steps` (a Generation stopped early keeps what it ran)."""
    from engine.runtime.kernels.threads import give_way, turn_threads  # torch: imported when a decode first runs

    it = iter(steps)
    try:
        first, ran_s, gave_s = True, 0.0, 0.0
        while True:
            t0 = time.monotonic()
            if not first:  # not queued yet: nobody waits behind it
                gave_s += give_way(min(GIVE_S, GIVE_CREDIT_S + ran_s - gave_s))
            with decode_slot(who, on_wait if first else lambda busy: None, sliced=True,
                             on_queued=on_queued if first else lambda at: None, opening=opening and first):
                t1, away = time.monotonic(), preempt.away_ms()
                waited((t1 - t0) * 1e3)
                try:
                    with turn_threads():  # one thread while the cores are wanted elsewhere
                        item = next(it)
                except StopIteration:
                    return
                away = preempt.away_ms() - away  # paused at a layer for others' openings
                ran_s += time.monotonic() - t1 - away / 1e3
            if away:
                waited(away)
            first = False
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
