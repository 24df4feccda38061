"""The workbench under load: N browser sessions (Debian's Chromium via Playwright, one context each)
on one server on 127.0.0.1, doing a tuner's actions at once for a fixed number of rounds:

    live       Generate on the Live page (a fixed γ, a short run), until its "Stored as run" line
    runs       the Runs page opened from the sidebar, and its runs downloaded as CSV
    compare    the Compare page opened, and a comparison of its default policies run
    what-if    Compare's What-if tab replaying policies over the stored traces
    profile    (session 0, first round) a Profile sweep started; it runs beside everything else

It prints per action the median and p95 latency (a page opened from the sidebar twice: from the
click sent, and from the click reaching the page, past the browser's own backlog), the Live runs'
wait for their first turn in the decode slot (in seconds and in decodes; whether any run was
overtaken by one queued after it), every page error, the server's memory after the first pair
load and after each session count, how the Profile sweep ended (the Profile page reloaded until
it says, after the sessions), and checks the database at the end: every run a session saw stored
is stored once, the stored live runs are exactly those, and each of the sweep's cells is stored
once.

    python -m engine bench load [--sessions 2,4,8] [--rounds 2] [--think 1,4] [--json]

Never asserts a time; tests/test_browser.py runs it on two sessions."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import browser as B

TIMEOUT_MS = 900_000
# A session pauses this long (seconds, uniform, seeded per session) before each action, as a user
# reads what the last one showed. Without pauses, sessions that take turns at the model end their
# decodes together and open the same page in the same instant, every browser on these two cores.
THINK_S = (1.0, 4.0)
LIVE_POLICY = "fixed:2"  # a fixed γ: every session's run costs the same, whatever was stored before
RUN_ID = re.compile(r"Stored as run (\S+)")
# The long waits (a decode, a comparison) look at the page once a second: eight tabs polling
# faster took a large share of the cores from the server they measure (a user's browser never polls).
WAIT_POLL_MS = 1000
# When the page last heard a click (ms since the epoch, as time.time() × 1000: one machine's clock).
CLICKED = "document.addEventListener('click', () => { window.__clickedAt = Date.now(); }, true);"
PAGE_SIDE = " (page side)"
SWEEP_ENDED = re.compile(r"Sweep (\S+)(?::| failed after) (\d+)/(\d+)")
SWEEP_WAIT_S = 900  # the sweep started in the first round may run past the last session
COMPARED = """() => [...document.querySelectorAll('[data-testid^="stAlertContent"]')]
    .some(e => e.textContent.includes('identical'))"""


@dataclass
class Session:
    """What one browser session did and saw."""

    name: str
    latencies: dict[str, list[float]] = field(default_factory=dict)
    run_ids: list[str] = field(default_factory=list)  # the live runs it saw stored
    compares: int = 0
    errors: list[str] = field(default_factory=list)

    def took(self, action: str, seconds: float) -> None:
        self.latencies.setdefault(action, []).append(seconds)


# -- one session's actions ---------------------------------------------------------------------
async def _idle(page, timeout_s: float = TIMEOUT_MS / 1e3) -> None:
    """bench/browser.py's wait_idle, for the async API."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < B.QUIET_POLLS:
        await page.wait_for_timeout(B.POLL_MS)
        if await page.evaluate(B.IDLE):
            quiet += 1
            continue
        quiet = 0
        await page.wait_for_function(B.IDLE, timeout=max(deadline - time.monotonic(), 0.001) * 1e3, polling=B.POLL_MS)


async def _errors(page, s: Session, after: str) -> None:
    for e in await page.locator('[data-testid="stException"]').all():
        s.errors.append(f"{after}: traceback: {(await e.inner_text()).splitlines()[0][:160]}")
    for a in await page.locator('[data-testid="stAlertContentError"]').all():
        s.errors.append(f"{after}: {(await a.inner_text())[:160]}")


async def _open(page, title: str, ready: str | None = None) -> float:
    """Opens a page from the sidebar, as a user does, until its heading (and `ready`, a locator
    of what the page is for) shows: the latency a user waits for. Not until idle: the idle test
    itself takes QUIET_POLLS polls. Returns the seconds from the click reaching the page (CLICKED)
    to then: the rest of the wait is the browser still drawing what it showed before."""
    heading = page.get_by_role("heading", name=title, exact=True).first
    await page.get_by_role("link", name=title, exact=True).click()
    try:
        await heading.wait_for(timeout=60_000)
    except Exception:  # noqa: BLE001 - a click landing as a run ends in st.rerun() is dropped: once more
        await page.get_by_role("link", name=title, exact=True).click()
        await heading.wait_for(timeout=TIMEOUT_MS)
    if ready:
        await page.locator(ready).first.wait_for(timeout=TIMEOUT_MS)
    return time.time() - await page.evaluate("() => window.__clickedAt") / 1e3


async def _go(page, title: str) -> None:
    await _open(page, title)
    await _idle(page)


async def _timed(s: Session, action: str, step) -> None:
    t0 = time.monotonic()
    await step()
    s.took(action, time.monotonic() - t0)


async def _page_load(s: Session, action: str, page, title: str, ready: str) -> None:
    """A page opened from the sidebar: the wait from the click sent (`action`) and from the click
    reaching the page (`action` + PAGE_SIDE). On these two cores eight browsers share the CPU
    with the server, and a click waits in a browser still drawing its last page (a user's own
    machine draws it in a fraction of that); the page-side figure is the server's and the page's."""
    t0 = time.monotonic()
    page_side = await _open(page, title, ready)
    s.took(action, time.monotonic() - t0)
    s.took(action + PAGE_SIDE, page_side)


async def live(page, s: Session, prompt: str, max_new: int) -> None:
    await _go(page, "Live decode")
    await page.get_by_label("…or any policy spec").fill(LIVE_POLICY)
    await page.get_by_label("Max new tokens").fill(str(max_new))
    await page.get_by_label("Prompt").fill(prompt)
    before = await page.evaluate(B.STORED_LINE)

    async def generate():
        await page.get_by_role("button", name="Generate").click()
        await page.wait_for_function(f"(before) => {{ const t = ({B.STORED_LINE})(); return t && t !== before; }}",
                                     arg=before, timeout=TIMEOUT_MS, polling=WAIT_POLL_MS)

    await _timed(s, "live", generate)
    line = await page.evaluate(B.STORED_LINE)
    if m := RUN_ID.search(line):
        s.run_ids.append(m.group(1))
    else:
        s.errors.append(f"live: not stored: {line[:160]}")
    await _idle(page)
    await _errors(page, s, "live")


async def runs(page, s: Session) -> None:
    await _page_load(s, "runs page", page, "Runs", '[data-testid="stDataFrame"]')
    await _idle(page)

    async def download():
        async with page.expect_download(timeout=TIMEOUT_MS) as dl:
            await page.get_by_role("button", name="Runs (CSV)", exact=True).click()
        await (await dl.value).path()

    await _timed(s, "runs download", download)
    await _errors(page, s, "runs")


async def compare(page, s: Session, max_new: int) -> None:
    await _page_load(s, "compare page", page, "Compare", '[data-testid="stFormSubmitButton"]')
    await _idle(page)
    await page.get_by_label("Max new tokens").fill(str(max_new))

    async def run():
        await page.get_by_role("button", name="Compare", exact=True).click()
        await page.wait_for_function(COMPARED, timeout=TIMEOUT_MS, polling=WAIT_POLL_MS)
        await _idle(page)

    await _timed(s, "compare", run)
    s.compares += 1
    await _errors(page, s, "compare")


async def whatif(page, s: Session) -> None:
    await page.get_by_role("tab", name=re.compile("What-if")).click()

    async def replay():
        button = page.get_by_role("button", name="Replay", exact=True)
        if await button.count() == 0:  # no traces stored yet: the tab says what to run instead
            return
        await button.click()
        await _idle(page)

    await _timed(s, "what-if", replay)
    await _errors(page, s, "what-if")


async def profile(page, s: Session) -> None:
    async def start():
        await _go(page, "Profile")
        await page.get_by_label("Max new tokens").fill("8")
        await page.get_by_role("button", name="Start").click()
        await page.locator('[data-testid="stProgress"]').first.wait_for(timeout=TIMEOUT_MS)

    await _timed(s, "profile start", start)
    await _errors(page, s, "profile")


async def session(browser, url: str, s: Session, index: int, rounds: int, max_new: int, sweep: bool,
                  think_s: tuple[float, float] = THINK_S) -> None:
    context = await browser.new_context(viewport={"width": 1400, "height": 2000}, accept_downloads=True)
    await context.add_init_script(CLICKED)
    page = await context.new_page()
    rng = random.Random(index)  # the same pauses on every run of the bench

    async def think() -> None:  # reading what the last action showed
        await page.wait_for_timeout(rng.uniform(*think_s) * 1e3)

    try:
        await page.goto(url, wait_until="networkidle")
        await page.get_by_role("heading", name="Live decode").wait_for(timeout=TIMEOUT_MS)
        for r in range(rounds):
            if sweep and r == 0:
                await profile(page, s)
            for action in (lambda: live(page, s, f"Session {index}, round {r}: {B.DEFAULT_PROMPT}", max_new),
                           lambda: runs(page, s), lambda: compare(page, s, max_new), lambda: whatif(page, s)):
                await think()
                await action()
    except Exception as e:  # noqa: BLE001 - a session that cannot go on is a finding, not a crash
        s.errors.append(f"stopped: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    finally:
        await context.close()


# -- the server and the database ---------------------------------------------------------------
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def config_of(run: dict) -> dict:
    """A stored run's `config` (the store hands JSON back as text)."""
    c = run.get("config")
    return c if isinstance(c, dict) else json.loads(c) if isinstance(c, str) and c else {}


def queue_fairness(live_runs: list[dict]) -> dict:
    """From the stored live runs' queue stamps: the longest wait for a run's first turn in the
    decode slot, in seconds and in decodes (against the median run's own wall time, which leaves
    out its turns: engine/lab/decode_lock.stepped), how many runs were overtaken (their first turn came
    after that of a run queued behind them), and the median run's total wait in its later turns
    against its own wall time (the price of taking turns)."""
    configs = [config_of(r) for r in live_runs]
    stamps = [(c["queued_at"], c["queued_at"] + c["queue_ms"] / 1e3) for c in configs if "queue_ms" in c]
    overtaken = sum(1 for qa, sa in stamps for qb, sb in stamps if qb > qa and sb < sa)
    waits = [(s - q) for q, s in stamps]
    decode_s = statistics.median(r["wall_ms"] / 1e3 for r in live_runs) if live_runs else float("nan")
    turns = [c.get("turns_ms", 0.0) / r["wall_ms"] for c, r in zip(configs, live_runs) if r["wall_ms"]]
    return {"runs": len(stamps), "max_wait_s": round(max(waits, default=0.0), 2),
            "max_wait_decodes": round(max(waits, default=0.0) / decode_s, 1) if live_runs else 0.0,
            "overtaken": overtaken, "turns_per_own_wall": round(statistics.median(turns), 2) if turns else 0.0}


def check_store(db: Path, sessions: list[Session]) -> dict:
    """Every live run a session saw stored is stored once; the stored live runs are exactly those."""
    from store import Store

    with Store(db, read_only=True) as st:
        stored = st.runs().to_dict("records")
    ids = [r["run_id"] for r in stored]
    seen = [i for s in sessions for i in s.run_ids]
    live_stored = [r for r in stored if str(r["prompt"]).startswith("Session ")]
    compare_stored = [r for r in stored if config_of(r).get("compare")]
    return {"live_seen": len(seen), "live_stored": len(live_stored),
            "seen_stored_once": all(ids.count(i) == 1 for i in seen) and len(set(seen)) == len(seen),
            "compares": sum(s.compares for s in sessions), "compare_runs_stored": len(compare_stored),
            "queue": queue_fairness(live_stored)}


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def summarize(sessions: list[Session]) -> dict[str, dict[str, float]]:
    actions: dict[str, list[float]] = {}
    for s in sessions:
        for a, xs in s.latencies.items():
            actions.setdefault(a, []).extend(xs)
    return {a: {"n": len(xs), "median_s": round(statistics.median(xs), 2), "p95_s": round(_p95(xs), 2)}
            for a, xs in actions.items()}


@contextlib.asynccontextmanager
async def _chromium():
    """Debian's Chromium under Playwright, closed whatever happens."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=B.CHROMIUM, args=B.CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


async def _load(url: str, n: int, rounds: int, max_new: int, sweep: bool,
                think_s: tuple[float, float] = THINK_S) -> list[Session]:
    async with _chromium() as browser:
        sessions = [Session(f"session {i}") for i in range(n)]
        await asyncio.gather(*(session(browser, url, s, i, rounds, max_new, sweep and i == 0, think_s)
                               for i, s in enumerate(sessions)))
        return sessions


async def _sweep_end(url: str, wait_s: float = SWEEP_WAIT_S) -> dict:
    """The Profile page, reloaded every few seconds until the sweep says how it ended: its name,
    state, items done of total, and the seconds waited after the last session."""
    async with _chromium() as browser:
        page = await browser.new_page(viewport={"width": 1400, "height": 900})
        await page.add_init_script(CLICKED)  # _open reads when the page heard the click
        t0 = time.monotonic()
        await page.goto(url)
        while True:
            await _go(page, "Profile")
            for alert in await page.locator('[data-testid^="stAlertContent"]').all():
                text = await alert.inner_text()
                if m := SWEEP_ENDED.search(text):
                    state = "failed" if "failed" in text else "stopped" if "stopped" in text else "finished"
                    return {"name": m[1], "state": state, "done": int(m[2]), "total": int(m[3]),
                            "waited_s": round(time.monotonic() - t0, 1)}
            if time.monotonic() - t0 > wait_s:
                return {"name": None, "state": f"still running after {wait_s:g} s", "done": 0, "total": 0,
                        "waited_s": round(time.monotonic() - t0, 1)}
            await page.wait_for_timeout(3000)
            await page.reload()


def check_sweep(db: Path, name: str | None) -> dict:
    """The sweep's stored runs: how many, whether each cell is stored once, how many failed."""
    from engine.service.sweeps.serial import cell_key
    from store import Store

    if name is None:
        return {"runs": 0, "cells_once": False, "failed": 0}
    with Store(db, read_only=True) as st:
        runs = st.runs(sweep=name)
    keys = [cell_key(r) for r in runs.to_dict("records")]
    failed = int(runs["error"].notna().sum()) if "error" in runs else 0
    return {"runs": len(keys), "cells_once": len(set(keys)) == len(keys), "failed": failed}


def measure(counts: list[int], rounds: int, max_new: int, env: dict[str, str], say=lambda m: None,
            warm: bool = True, think_s: tuple[float, float] = THINK_S) -> dict:
    """One server and database for the whole run: a single session first (the pair loads; `warm`
    False skips it, and the memory growth is then not measured), then each session count in turn
    (the first of them starts a Profile sweep)."""
    if (why := B.browser_missing()):
        raise RuntimeError(why)
    out: dict = {"sessions": {}, "memory_mib": {}, "think_s": list(think_s)}
    seen: list[Session] = []
    with tempfile.TemporaryDirectory(prefix="speclab-load-") as tmp:
        db = Path(tmp) / "load.duckdb"
        procs: list = []
        with B.app_server({**env, "SPECLAB_DB": str(db), "HF_HUB_OFFLINE": "1"}, procs=procs) as url:
            pid = procs[0].pid
            out["memory_mib"]["server started"] = round(rss_mib(pid), 1)
            if warm:
                say("one session first: the pair loads once")
                seen += asyncio.run(_load(url, 1, 1, max_new, sweep=False, think_s=think_s))
                out["memory_mib"]["after one session"] = round(rss_mib(pid), 1)
            for i, n in enumerate(counts):
                say(f"{n} sessions × {rounds} rounds")
                t0 = time.monotonic()
                sessions = asyncio.run(_load(url, n, rounds, max_new, sweep=i == 0, think_s=think_s))
                seen += sessions
                out["sessions"][str(n)] = {"wall_s": round(time.monotonic() - t0, 1), "actions": summarize(sessions),
                                           "errors": [f"{s.name}: {e}" for s in sessions for e in s.errors]}
                out["memory_mib"][f"after {n} sessions"] = round(rss_mib(pid), 1)
            say("the Profile sweep: waiting for it to end")
            out["sweep"] = asyncio.run(_sweep_end(url))
        out["store"] = check_store(db, seen)  # the server is gone: the file is free to read
        out["sweep"].update(check_sweep(db, out["sweep"]["name"]))
    mem = out["memory_mib"]
    if warm:  # what the sessions added, against what the first one's load took (imports and the pair)
        pair = mem["after one session"] - mem["server started"]
        out["memory_growth_in_pairs"] = round((mem[f"after {counts[-1]} sessions"] - mem["after one session"]) / pair, 2)
    return out


def report(r: dict) -> str:
    lines = [f"each session paused {r['think_s'][0]:g}–{r['think_s'][1]:g} s before each action"]
    for n, res in r["sessions"].items():
        lines.append(f"{n} sessions ({res['wall_s']} s):")
        for a, f in res["actions"].items():
            lines.append(f"  {a:14s} n {f['n']:3d}  median {f['median_s']:6.2f} s  p95 {f['p95_s']:6.2f} s")
        lines.append(f"  page errors: {len(res['errors'])}" + "".join(f"\n    {e}" for e in res["errors"]))
    st, q = r["store"], r["store"]["queue"]
    lines.append(f"store: live runs seen stored {st['live_seen']}, stored {st['live_stored']}, each once "
                 f"{st['seen_stored_once']}; comparisons {st['compares']}, their runs stored {st['compare_runs_stored']}")
    lines.append(f"decode slot: {q['runs']} live runs, longest wait for a first turn {q['max_wait_s']} s "
                 f"({q['max_wait_decodes']} decodes of a live run's own length), overtaken {q['overtaken']}; "
                 f"a run's later turns waited {q['turns_per_own_wall']}× its own wall time (median)")
    sw = r["sweep"]
    lines.append(f"profile sweep {sw['name']}: {sw['state']}, {sw['done']}/{sw['total']} items "
                 f"({sw['waited_s']} s after the last session); runs stored {sw['runs']}, each cell once "
                 f"{sw['cells_once']}, failed {sw['failed']}")
    lines.append("memory (MiB): " + ", ".join(f"{k} {v}" for k, v in r["memory_mib"].items())
                 + (f"; growth over the sessions {r['memory_growth_in_pairs']} of the first session's load"
                    if "memory_growth_in_pairs" in r else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench load", description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", default="2,4,8", help="session counts, one after another")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16, help="each live run's and comparison's length")
    ap.add_argument("--target", default="", help="HF id or local dir (default: the embedded model)")
    ap.add_argument("--draft", default="")
    ap.add_argument("--think", default=",".join(map(str, THINK_S)),
                    help="a session's pause before each action, MIN,MAX seconds (0,0: none, a stress test)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.sessions.split(",") if x.strip()]
    if not counts or min(counts) < 1 or a.rounds < 1:
        raise ValueError("--sessions needs counts ≥ 1 and --rounds ≥ 1")
    try:
        think = tuple(float(x) for x in a.think.split(","))
    except ValueError:
        think = ()
    if len(think) != 2 or not 0 <= think[0] <= think[1]:
        raise ValueError(f"--think needs MIN,MAX seconds with 0 ≤ MIN ≤ MAX, got {a.think!r}")
    r = measure(counts, a.rounds, a.max_new_tokens, {"SPECLAB_TARGET": a.target, "SPECLAB_DRAFT": a.draft},
                say=lambda m: print(m, file=sys.stderr, flush=True), think_s=think)
    print(json.dumps(r) if a.json else report(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
