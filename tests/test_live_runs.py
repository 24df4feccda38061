"""The Live page's decode on a thread of its own (engine/service/session.py): Stop is heard
between two steps and the run is stored as stopped; a bad request fails before any thread starts.
The page's Stop button itself is pressed in a real browser (tests/test_browser.py)."""
import json
import time

import pytest

from engine.service.generation import Request
from engine.service.session import start_live
from store import Store


def test_stop_ends_a_live_run_within_one_step_and_it_is_stored(tiny_pair, tmp_path, monkeypatch):
    from engine.decode.policies.fixed import FixedPolicy

    choose = FixedPolicy.choose

    def slow(self, state):  # a step long enough that a stop lands mid-run
        time.sleep(0.02)
        return choose(self, state)

    monkeypatch.setattr(FixedPolicy, "choose", slow)
    db = tmp_path / "x.duckdb"
    run = start_live(tiny_pair, Request("Hello there", "fixed:1", max_new_tokens=200), str(db))
    deadline = time.monotonic() + 60
    while len(run.snapshot().steps) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    run.stop()
    heard = len(run.snapshot().steps)
    snap = run.wait(60)
    assert snap.state == "stopped" and len(snap.steps) <= heard + 1, (heard, len(snap.steps))
    assert snap.summary["stop_reason"] == "stopped" and len(snap.token_ids) < 200
    assert snap.stored.level == "success" and snap.stored.message.startswith("Stored as run ")
    with Store(db) as st:
        runs = st.runs()
    assert list(runs["stop_reason"]) == ["stopped"] and int(runs["n_tokens"].iloc[0]) == len(snap.token_ids)


def test_a_bad_request_fails_before_a_thread_starts(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="fixed:k"):
        start_live(tiny_pair, Request("Hello", "fixed:99"), str(tmp_path / "x.duckdb"))
    assert not (tmp_path / "x.duckdb").exists()


def test_a_failing_run_is_one_line_and_stores_nothing(tiny_pair, tmp_path):
    db = tmp_path / "x.duckdb"
    run = start_live(tiny_pair, Request("x" * 5000, "fixed:2"), str(db))  # over the tiny target's context
    snap = run.wait(60)
    assert snap.state == "failed" and "\n" not in snap.error and "context" in snap.error, snap.error
    assert not db.exists()


def test_live_runs_pressed_together_take_turns_and_match_their_solo_runs(tiny_pair, tmp_path):
    """Three sessions' decodes at once advance a step each in turn (engine/lab/decode_lock.stepped):
    each makes exactly what it makes alone, greedy and sampled, at any KV tier; each is stored
    once with its waits; and its wall time is its own (the turns it waited are not in it)."""
    from engine.runtime.prefix.cache import PrefixCache
    from engine.service.generation import generate

    reqs = [Request("Write a haiku about the sea.", "fixed:3", max_new_tokens=24, seed=1),
            Request("List three prime numbers.", "ar", max_new_tokens=24, kv_tier="int8", seed=2),
            Request("Explain recursion briefly.", "fixed:2", max_new_tokens=24, temperature=0.8, seed=3)]
    solo = [generate(tiny_pair, r, prefix=PrefixCache())[0].token_ids for r in reqs]
    db, prefix = tmp_path / "x.duckdb", PrefixCache()
    t0 = time.monotonic()
    runs = [start_live(tiny_pair, r, str(db), prefix=prefix) for r in reqs]
    snaps = [r.wait(120) for r in runs]
    together_ms = (time.monotonic() - t0) * 1e3
    assert [s.state for s in snaps] == ["finished"] * 3, [s.error for s in snaps]
    assert [s.token_ids for s in snaps] == solo
    with Store(db) as st:
        stored = st.runs()
    assert sorted(stored["n_tokens"]) == sorted(len(t) for t in solo)
    configs = [json.loads(c) if isinstance(c, str) else c for c in stored["config"]]
    assert all({"queued_at", "queue_ms", "turns_ms"} <= set(c) for c in configs)
    # Each run's wall time leaves out the turns it waited: the three, summed, fit in the time all
    # three took together (had each counted the others' steps, the sum would be near three times it).
    assert sum(stored["wall_ms"]) <= together_ms, (list(stored["wall_ms"]), together_ms)


def test_turns_paused_at_every_layer_for_openings_make_what_they_make_alone(tiny_pair, tmp_path, monkeypatch):
    """With a slice of nothing, every stepped turn hands the slot over at its forward's next layer
    whenever an opening waits (engine/runtime/preempt.py): prefills and steps of three runs pressed
    together interleave layer by layer, on one shared pair, and each still makes exactly what it
    makes alone; the pauses count as waits, never as a run's own wall time."""
    from engine.lab import decode_lock
    from engine.runtime import preempt
    from engine.runtime.prefix.cache import PrefixCache
    from engine.service.generation import generate

    reqs = [Request("Write a haiku about the sea.", "fixed:3", max_new_tokens=16, seed=1),
            Request("List three prime numbers.", "ar", max_new_tokens=16, kv_tier="int8", seed=2),
            Request("Explain recursion briefly.", "fixed:2", max_new_tokens=16, temperature=0.8, seed=3)]
    solo = [generate(tiny_pair, r, prefix=PrefixCache())[0].token_ids for r in reqs]
    paused: list[float] = []

    def counted() -> float:
        ms = decode_lock._hand_over()
        if ms:
            paused.append(ms)
        return ms

    monkeypatch.setattr(decode_lock, "SLICE_S", 0.0)
    monkeypatch.setattr(preempt, "_HANDLER", [counted])
    for model in (tiny_pair.target, tiny_pair.draft):
        preempt.at_layers(model)
    try:
        db = tmp_path / "x.duckdb"
        t0 = time.monotonic()
        with decode_lock.decode_slot("a test"):  # all three openings queue before any runs
            runs = [start_live(tiny_pair, r, str(db), prefix=PrefixCache()) for r in reqs]
            while decode_lock.queued() < len(runs):
                time.sleep(0.001)
        snaps = [r.wait(120) for r in runs]
        together_ms = (time.monotonic() - t0) * 1e3
    finally:
        for model in (tiny_pair.target, tiny_pair.draft):
            for hook in model.__dict__.pop(preempt.HOOKED):
                hook.remove()
    assert [s.state for s in snaps] == ["finished"] * 3, [s.error for s in snaps]
    assert len(paused) >= 3, "hardly a turn was paused at a layer"
    assert [s.token_ids for s in snaps] == solo
    with Store(db) as st:
        stored = st.runs()
    assert sum(stored["wall_ms"]) <= together_ms, (list(stored["wall_ms"]), together_ms)
    configs = [json.loads(c) if isinstance(c, str) else c for c in stored["config"]]
    assert sum(c["turns_ms"] + c["queue_ms"] for c in configs) >= 0.9 * sum(paused)  # the pauses are waits
