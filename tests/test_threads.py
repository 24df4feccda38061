"""Decode turns that drop to one thread under CPU pressure (engine/runtime/kernels/threads.py), only for
pairs whose decodes the probe found the same on one thread (engine/lab/thread_probe.py), and the
laws' sums that make them so (engine/oracles/sampling.law_sum)."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.lab import thread_probe
from engine.oracles.sampling import law_sum
from engine.runtime.kernels import threads


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pressure(stalls: list[float], clock: _Clock) -> threads.Pressure:
    """A Pressure over a scripted stall counter, sampled by hand (no daemon thread)."""
    p = threads.Pressure(read=lambda: stalls[0], clock=clock, window_s=1.0)
    p._thread = threading.current_thread()  # never start the sampler: the test samples
    return p


def test_cpu_stall_reads_psi_and_says_none_without_it(tmp_path):
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=1.00 avg60=2.00 avg300=3.00 total=2500000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert threads.cpu_stall_s(str(psi)) == 2.5
    assert threads.cpu_stall_s(str(tmp_path / "missing")) is None
    (tmp_path / "odd").write_text("garbage\n")
    assert threads.cpu_stall_s(str(tmp_path / "odd")) is None


def test_turns_drop_to_one_thread_under_pressure_and_come_back_after_the_hold():
    clock, stalls = _Clock(), [0.0]
    pressure = _pressure(stalls, clock)
    t = threads.TurnThreads(4, pressure, clock=clock, contended=0.2, hold_s=2.0)
    assert t.enabled and t.next() == 4  # no samples yet: calm
    for _ in range(5):  # a calm second: 0.05 s stalled per second
        clock.now += 0.25
        stalls[0] += 0.0125
        pressure.sample()
    assert pressure.share() == pytest.approx(0.05) and t.next() == 4
    for _ in range(4):  # a busy second: half of it some task waited for a CPU
        clock.now += 0.25
        stalls[0] += 0.125
        pressure.sample()
    assert pressure.share() == pytest.approx(0.5) and t.next() == 1
    for _ in range(4):  # calm again; the window forgets the busy second, the hold keeps one thread a while
        clock.now += 0.25
        pressure.sample()
    assert pressure.share() < 0.2 and t.next() == 1  # within the hold of the last pressure a turn saw
    clock.now += 1.1
    assert t.next() == 4
    assert t.turns == {4: 3, 1: 2}


def test_a_running_decode_gives_way_under_extreme_pressure_at_most_as_long_as_allowed():
    clock, stalls = _Clock(), [0.0]
    pressure = _pressure(stalls, clock)
    t = threads.TurnThreads(2, pressure, clock=clock)
    slept: list[float] = []

    def sleep(s: float) -> None:  # time passes, 0.95 of it with some task waiting for a CPU
        slept.append(s)
        clock.now += s
        stalls[0] += 0.95 * s
        pressure.sample()

    pressure.sample()
    assert t.give_way(0.3, sleep=sleep) == 0.0 and not slept  # calm (no stall yet): straight on
    for _ in range(4):
        sleep(0.25)
    slept.clear()
    assert pressure.share() == pytest.approx(0.95)
    assert t.give_way(0.35, sleep=sleep) == pytest.approx(0.35)  # oversubscribed: waits as long as it may
    assert slept == pytest.approx([0.1, 0.1, 0.1, 0.05])  # a pressure sample's period at a time, never past it
    for _ in range(8):  # half the second stalled: busy, not oversubscribed
        clock.now += 0.25
        stalls[0] += 0.125
        pressure.sample()
    assert t.give_way(0.35, sleep=sleep) == 0.0
    assert threads.TurnThreads(1, pressure, clock=clock).give_way(5.0, sleep=sleep) == 0.0  # one core: never


def test_without_psi_or_with_one_core_turns_keep_every_core():
    clock = _Clock()
    none = threads.Pressure(read=lambda: None, clock=clock)
    assert not none.available and threads.TurnThreads(4, none, clock=clock).next() == 4
    busy = _pressure([0.0], clock)
    assert threads.TurnThreads(1, busy, clock=clock).next() == 1 and not threads.TurnThreads(1, busy).enabled


def test_a_turn_drops_only_while_every_pair_noted_is_invariant(monkeypatch):
    monkeypatch.setattr(threads, "_PAIRS", {})
    cores = torch.get_num_threads()
    always = threads.TurnThreads(cores, threads.Pressure(read=lambda: 0.0))
    always.next = lambda: 1  # under pressure whenever asked
    always.give_way = lambda most_s: most_s  # and oversubscribed

    def inside() -> tuple[int, int]:
        with threads.turn_threads(lambda: always) as n:
            return n, torch.get_num_threads()

    assert inside() == (cores, cores)  # no pair noted: nothing known to be invariant
    assert threads.give_way(0.5, lambda: always) == 0.0  # nor is this the workbench (a CLI never waits)
    threads.note_pair("a", True)
    assert threads.give_way(0.5, lambda: always) == 0.5
    if cores > 1:
        assert inside() == (1, 1) and torch.get_num_threads() == cores  # the count is back after the turn
    threads.note_pair("b", False)
    assert inside() == (cores, cores)
    threads.note_pair("b", True)
    assert threads.may_drop()


def test_law_sums_have_the_same_bits_on_any_thread_count():
    cores = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(3, 49_152, generator=gen)  # over ATen's grain: a plain sum is split among threads
    try:
        torch.set_num_threads(1)
        one = law_sum(x)
        torch.set_num_threads(max(cores, 2))
        assert torch.equal(one, law_sum(x)) and one.shape == (3, 1)
    finally:
        torch.set_num_threads(cores)
    assert torch.allclose(one[:, 0], x.double().sum(-1).float(), rtol=1e-6)
    small = torch.rand(5, 100, generator=gen)
    assert torch.equal(law_sum(small), small.sum(-1, keepdim=True))  # under a block: the plain sum


def test_the_probe_passes_a_pair_on_the_row_kernels_and_fails_one_whose_reads_follow_the_thread_count(
        tiny_pair, monkeypatch):
    if torch.get_num_threads() < 2:
        pytest.skip("one core: nothing to compare")
    holds: list[int] = []

    class Hold:
        def __enter__(self):
            holds.append(1)

        def __exit__(self, *exc):
            return False

    assert thread_probe.thread_invariant(tiny_pair, torch.get_num_threads(), Hold)
    assert len(holds) > 2 * thread_probe.NEW_TOKENS  # a hold per step: other decodes take turns between
    head = tiny_pair.target.get_output_embeddings()
    real = head.forward

    def skewed(x):  # a read whose last bits follow the thread count, as a split reduction's do
        return real(x) + torch.get_num_threads() * 1e-3

    monkeypatch.setattr(head, "forward", skewed)
    assert not thread_probe.thread_invariant(tiny_pair, torch.get_num_threads())
    assert not thread_probe.thread_invariant(tiny_pair, 1)  # one core: nothing to drop to
