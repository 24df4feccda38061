"""The process's decode slot (engine/lab/decode_lock.py): first come, first served (a session's opening
turn ahead of the later turns of decodes already running), and a waiter that gives up leaves the
queue as if it had never come."""
from __future__ import annotations

import threading
import time

import pytest

from engine.lab import decode_lock


def _queue_up(names: list[str], order: list[str], opening: bool = False) -> list[threading.Thread]:
    """One thread per name, each queued (behind the ones before it) before the next starts."""
    threads = []
    for name in names:
        def take(name=name):
            with decode_lock.decode_slot(name, opening=opening):
                order.append(name)
                time.sleep(0.01)  # a decode: the next in line must not slip in meanwhile
        t = threading.Thread(target=take)
        before = decode_lock.queued()
        t.start()
        deadline = time.monotonic() + 10
        while decode_lock.queued() == before and time.monotonic() < deadline:
            time.sleep(0.001)
        threads.append(t)
    return threads


def test_the_slot_is_served_in_arrival_order():
    order: list[str] = []
    with decode_lock.decode_slot("a sweep"):
        assert decode_lock.holder() == "a sweep" and decode_lock.queued() == 0
        names = [f"session {i}" for i in range(8)]
        threads = _queue_up(names, order)
        assert decode_lock.queued() == len(names)
    for t in threads:
        t.join(10)
    assert order == names  # nobody waited behind a decode that came after it
    assert decode_lock.holder() == "" and decode_lock.queued() == 0


def test_openings_go_ahead_of_later_turns_in_arrival_order():
    """Sessions' first turns queue behind the openings already waiting, ahead of the later turns
    of decodes already running, and never ahead of the holder."""
    order: list[str] = []
    with decode_lock.decode_slot("a sweep"):
        threads = _queue_up(["later 1", "later 2"], order)
        threads += _queue_up(["new 1", "new 2"], order, opening=True)
        threads += _queue_up(["later 3"], order)
        threads += _queue_up(["new 3"], order, opening=True)
        assert decode_lock.queued() == 6 and decode_lock.holder() == "a sweep"
    for t in threads:
        t.join(10)
    assert order == ["new 1", "new 2", "new 3", "later 1", "later 2", "later 3"]
    assert decode_lock.holder() == "" and decode_lock.queued() == 0


def test_a_new_stepped_decode_opens_after_the_step_in_progress():
    """Two decodes take turns; a third, opening, gets the turn after the step running when it
    came, not a turn after each of theirs; then all three take turns."""
    order: list[str] = []
    started = threading.Event()

    def steps(name: str, n: int):
        for i in range(n):
            order.append(f"{name}{i}")
            if name == "a" and i == 1:
                started.set()
                time.sleep(0.05)  # c queues during this step, with b's next turn already waiting
            time.sleep(0.005)
            yield i

    threads = [threading.Thread(target=lambda n=name: list(decode_lock.stepped(steps(n, 4), n))) for name in "ab"]
    with decode_lock.decode_slot("a sweep run"):
        for t in threads:
            before = decode_lock.queued()
            t.start()
            while decode_lock.queued() == before:
                time.sleep(0.001)
    assert started.wait(10)
    c = threading.Thread(target=lambda: list(decode_lock.stepped(steps("c", 2), "c", opening=True)))
    c.start()
    for t in threads + [c]:
        t.join(10)
    assert order.index("c0") == order.index("a1") + 1, order
    assert decode_lock.holder() == "" and decode_lock.queued() == 0


def test_a_waiter_that_gives_up_leaves_the_others_their_turn():
    order: list[str] = []
    seen: list[str] = []
    with decode_lock.decode_slot("a long decode"):
        threads = _queue_up(["first"], order)
        with pytest.raises(TimeoutError, match="busy: a long decode holds the model"):
            with decode_lock.decode_slot("impatient", on_wait=seen.append, wait_s=0.05):
                pass
        threads += _queue_up(["second"], order)
        assert seen == ["a long decode"] and decode_lock.queued() == 2
    for t in threads:
        t.join(10)
    assert order == ["first", "second"] and decode_lock.queued() == 0


def test_stepped_decodes_take_turns_a_step_each():
    """Three streaming decodes pressed together advance a step each in turn (round robin): the
    third's first step waits for one step of each decode ahead of it, not for their whole runs."""
    order: list[str] = []
    waits: dict[str, list[float]] = {}

    def steps(name: str):
        for i in range(4):
            order.append(f"{name}{i}")
            time.sleep(0.005)  # a step: long enough that every waiter has queued meanwhile
            yield i

    threads = []
    with decode_lock.decode_slot("a sweep run"):  # all three queue behind it, in this order
        for name in "abc":
            waits[name] = []
            t = threading.Thread(target=lambda n=name: list(decode_lock.stepped(steps(n), n, waited=waits[n].append)))
            before = decode_lock.queued()
            t.start()
            while decode_lock.queued() == before:
                time.sleep(0.001)
            threads.append(t)
    for t in threads:
        t.join(10)
    assert order == [f"{n}{i}" for i in range(4) for n in "abc"]
    assert all(len(w) == 5 for w in waits.values())  # a turn per step, and one that finds the end
    assert decode_lock.holder() == "" and decode_lock.queued() == 0


def test_closing_a_stepped_decode_closes_its_steps():
    closed: list[bool] = []

    def steps():
        try:
            yield from range(10)
        finally:
            closed.append(True)

    it = decode_lock.stepped(steps(), "a live decode")
    assert next(it) == 0 and next(it) == 1
    it.close()
    assert closed == [True] and decode_lock.holder() == "" and decode_lock.queued() == 0


def test_a_running_decode_gives_way_between_turns_within_its_credit(monkeypatch):
    from engine.runtime.kernels import threads

    asked: list[float] = []

    def give_way(most_s: float) -> float:  # the CPU oversubscribed throughout: it gives all it may
        assert decode_lock.holder() == "", "it gives way before it queues: nobody waits on it"
        asked.append(most_s)
        return most_s

    monkeypatch.setattr(threads, "give_way", give_way)
    ran: list[float] = []

    def steps():
        for i in range(6):
            t0 = time.monotonic()
            time.sleep(0.02)
            ran.append(time.monotonic() - t0)
            yield i

    assert list(decode_lock.stepped(steps(), "a decode")) == list(range(6))
    assert len(asked) == 6  # before each turn but the first (the last finds the steps ended)
    assert asked[:2] == [decode_lock.GIVE_S, decode_lock.GIVE_S]  # a burst: up to GIVE_S a time, on credit
    assert all(0 <= a <= decode_lock.GIVE_S for a in asked)
    # In all never more than the credit beyond its own turns: half its speed at worst, however long.
    assert sum(asked) <= decode_lock.GIVE_CREDIT_S + sum(ran) + 0.05
    assert sum(asked) >= decode_lock.GIVE_CREDIT_S


def _layers(name: str, order: list[str], n: int, layer_s: float):
    """A step whose forward passes a point before each of `n` layers (engine/runtime/preempt.py)."""
    from engine.runtime import preempt

    for i in range(n):
        preempt.point()
        order.append(f"{name}{i}")
        time.sleep(layer_s)


def test_a_long_turn_hands_the_slot_to_an_opening_at_a_layer_and_resumes(monkeypatch):
    """A stepped turn that has held the slot SLICE_S pauses at its forward's next layer while an
    opening waits, queued behind the openings and ahead of later turns; it resumes at that layer,
    and the pause counts as its wait (waited), not as its own time (preempt.away_ms)."""
    from engine.runtime import preempt

    monkeypatch.setattr(decode_lock, "SLICE_S", 0.05)
    order: list[str] = []
    waits: list[float] = []
    started = threading.Event()

    ready = threading.Event()

    def long_step():
        started.set()
        ready.wait(10)  # every other decode queued
        _layers("long", order, 20, 0.01)  # 0.2 s: it pauses once an opening waits and 0.05 s ran
        yield "long done"

    long_turn = threading.Thread(target=lambda: list(decode_lock.stepped(long_step(), "a sweep", waited=waits.append)))
    later_turn = threading.Thread(
        target=lambda: [order.append("later") for _ in decode_lock.stepped(iter([1]), "later")])

    def opening(name: str):
        with decode_lock.decode_slot(name, opening=True):
            order.append(name)
            time.sleep(0.03)

    long_turn.start()
    started.wait(10)
    newcomers = [threading.Thread(target=opening, args=(f"new {i}",)) for i in range(2)]
    for n, t in enumerate([later_turn, *newcomers], 1):
        t.start()
        while decode_lock.queued() < n:
            time.sleep(0.001)
    t0 = time.monotonic()
    ready.set()
    for t in [long_turn, later_turn, *newcomers]:
        t.join(10)
    at = order.index("new 0")
    assert order[at : at + 2] == ["new 0", "new 1"]  # both openings ran inside the long turn
    assert order[:at] == [f"long{i}" for i in range(at)] and at < 20  # it paused at a layer
    assert order[at + 2 : at + 2 + 20 - at] == [f"long{i}" for i in range(at, 20)]  # and went on from there
    assert order[-1] == "later"  # a later turn never goes ahead of a turn in progress
    assert len(waits) == 3 and waits[1] >= 50  # its queue wait, its pause (two openings of 30 ms), the end's
    assert time.monotonic() - t0 >= 0.2 + 0.06  # nothing of the long turn was skipped
    assert preempt.away_ms() == 0.0  # counted on the paused thread only
    assert decode_lock.holder() == "" and decode_lock.queued() == 0


def test_plain_holds_and_short_turns_are_never_paused(monkeypatch):
    """A plain hold (a cost table times what it runs) runs its layers through, however long and
    whoever waits; a stepped turn within its slice too."""
    order: list[str] = []
    started = threading.Event()

    def plain():
        with decode_lock.decode_slot("measuring the cost table"):
            started.set()
            _layers("plain", order, 10, 0.01)

    def opening():
        with decode_lock.decode_slot("a live decode", opening=True):
            order.append("new")

    monkeypatch.setattr(decode_lock, "SLICE_S", 0.0)
    holder = threading.Thread(target=plain)
    holder.start()
    started.wait(10)
    newcomer = threading.Thread(target=opening)
    newcomer.start()
    for t in (holder, newcomer):
        t.join(10)
    assert order == [f"plain{i}" for i in range(10)] + ["new"]
    monkeypatch.setattr(decode_lock, "SLICE_S", 10.0)
    order.clear()
    def turn():
        _layers("turn", order, 5, 0.01)
        yield 1

    stepper = threading.Thread(target=lambda: list(decode_lock.stepped(turn(), "a live decode")))
    stepper.start()
    newcomer = threading.Thread(target=opening)
    while not order:
        time.sleep(0.001)
    newcomer.start()
    for t in (stepper, newcomer):
        t.join(10)
    assert order == [f"turn{i}" for i in range(5)] + ["new"]
