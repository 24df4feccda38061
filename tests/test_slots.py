"""The process's decode slot (engine/lab/slots.py): first come, first served, and a waiter that
gives up leaves the queue as if it had never come."""
from __future__ import annotations

import threading
import time

import pytest

from engine.lab import slots


def _queue_up(names: list[str], order: list[str]) -> list[threading.Thread]:
    """One thread per name, each queued (behind the ones before it) before the next starts."""
    threads = []
    for name in names:
        def take(name=name):
            with slots.decode_slot(name):
                order.append(name)
                time.sleep(0.01)  # a decode: the next in line must not slip in meanwhile
        t = threading.Thread(target=take)
        before = slots.queued()
        t.start()
        deadline = time.monotonic() + 10
        while slots.queued() == before and time.monotonic() < deadline:
            time.sleep(0.001)
        threads.append(t)
    return threads


def test_the_slot_is_served_in_arrival_order():
    order: list[str] = []
    with slots.decode_slot("a sweep"):
        assert slots.holder() == "a sweep" and slots.queued() == 0
        names = [f"session {i}" for i in range(8)]
        threads = _queue_up(names, order)
        assert slots.queued() == len(names)
    for t in threads:
        t.join(10)
    assert order == names  # nobody waited behind a decode that came after it
    assert slots.holder() == "" and slots.queued() == 0


def test_a_waiter_that_gives_up_leaves_the_others_their_turn():
    order: list[str] = []
    seen: list[str] = []
    with slots.decode_slot("a long decode"):
        threads = _queue_up(["first"], order)
        with pytest.raises(TimeoutError, match="busy: a long decode holds the model"):
            with slots.decode_slot("impatient", on_wait=seen.append, wait_s=0.05):
                pass
        threads += _queue_up(["second"], order)
        assert seen == ["a long decode"] and slots.queued() == 2
    for t in threads:
        t.join(10)
    assert order == ["first", "second"] and slots.queued() == 0


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
    with slots.decode_slot("a sweep run"):  # all three queue behind it, in this order
        for name in "abc":
            waits[name] = []
            t = threading.Thread(target=lambda n=name: list(slots.stepped(steps(n), n, waited=waits[n].append)))
            before = slots.queued()
            t.start()
            while slots.queued() == before:
                time.sleep(0.001)
            threads.append(t)
    for t in threads:
        t.join(10)
    assert order == [f"{n}{i}" for i in range(4) for n in "abc"]
    assert all(len(w) == 5 for w in waits.values())  # a turn per step, and one that finds the end
    assert slots.holder() == "" and slots.queued() == 0


def test_closing_a_stepped_decode_closes_its_steps():
    closed: list[bool] = []

    def steps():
        try:
            yield from range(10)
        finally:
            closed.append(True)

    it = slots.stepped(steps(), "a live decode")
    assert next(it) == 0 and next(it) == 1
    it.close()
    assert closed == [True] and slots.holder() == "" and slots.queued() == 0
