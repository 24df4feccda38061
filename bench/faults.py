"""Faults injected into the workbench's own processes: what a team meets when a server dies, a disk
fills or a second server starts, each on a database of its own.

    sweep killed     `profile --sweep` SIGKILLed after some cells are stored, then rerun under its name
    decode killed    `generate` SIGKILLed while it streams, beside a run stored before
    retrain killed   `retrain` SIGKILLed half way (by a full retrain's time), beside a version stored before
    disk full        `generate` with no room for its write (the file-size limit of the child)
    second server    the workbench started again on a port one already serves
    server killed    the workbench's server SIGKILLed while its sweep runs, a Live decode streams and a
                     retrain fits, then restarted: the sweep started again under its name runs only
                     what is left, and the next retrain stores a version

After each fault the database must open read-write at once (no lock, no temporary file, nothing
staged left behind), hold every run whole (its steps emit the tokens it says it made) and
everything stored before, and the next action must succeed: the sweep resumes, a decode stores,
a retrain adds a version. Runs lost = runs stored (or seen finished) before the fault that are not there after.

    python -m engine bench faults [--json]          (the embedded pair; tests/test_faults.py: the tiny one)"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from bench import browser
from engine.base.names import DATA_DIR

REPO = Path(__file__).resolve().parents[1]
SPECKV_CSV = DATA_DIR / "speckv-phase2" / "phase2_step_results.csv"
SWEEP_POLICIES = "ar,fixed:2,fixed:3"
START_S = 120.0  # a child's longest wait for the point its fault is injected at (a cold model load)
# A full disk, as the child meets it: a file may hold this much (Python's check of its temporary
# folder writes 4 bytes), so the models load and decode and the database's log cannot take the run.
FULL_BYTES = 64
TAKEN = re.compile(r"Port \d+ is (not available|already in use)")  # Streamlit's words for a taken port


@dataclass
class Outcome:
    """One fault: what was injected, what was lost, whether the next action worked."""

    fault: str
    injected: bool = False  # the child was alive at the fault (not already finished)
    lost: int = 0  # runs (or controller versions) stored or reported finished before, missing after
    resumed: bool | None = None  # the action after the fault succeeded (a sweep: under its name)
    checks: list[str] = field(default_factory=list)  # the database checks that passed
    failed: list[str] = field(default_factory=list)  # those that did not (empty: all passed)
    line: str = ""  # the one line the child or the database said

    def check(self, name: str, ok: bool, why: str = "") -> None:
        (self.checks if ok else self.failed).append(name if ok else f"{name}: {why}" if why else name)

    @property
    def ok(self) -> bool:
        return self.injected and not self.failed and self.lost == 0 and self.resumed is not False


# -- children -------------------------------------------------------------------------------------
def _env(db: Path) -> dict[str, str]:
    # Unbuffered: a decode's stream reaches the pipe token by token, as it reaches a terminal.
    return dict(os.environ, HF_HUB_OFFLINE="1", SPECLAB_DB=str(db), TOKENIZERS_PARALLELISM="false",
                PYTHONUNBUFFERED="1")


def cli(args: list[str], db: Path, limit_bytes: int | None = None) -> subprocess.Popen:
    """`python -m engine ARGS --db DB` in a child (its file size capped at `limit_bytes`: a full disk)."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.Popen([sys.executable, "-m", "engine", *args, "--db", str(db)], cwd=REPO, env=_env(db),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=cap if limit_bytes is not None else None)


def finish(proc: subprocess.Popen, timeout: float = 600.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def kill_when(proc: subprocess.Popen, seen: Callable[[str, str], bool], timeout: float = START_S) -> tuple[bool, str, str]:
    """Reads the child's output until `seen(stdout, stderr)`, then SIGKILLs it: (alive at the kill, out, err)."""
    bufs = {proc.stdout: b"", proc.stderr: b""}
    for f in bufs:
        os.set_blocking(f.fileno(), False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for f in bufs:
            chunk = f.read()
            if chunk:
                bufs[f] += chunk
        out, err = (bufs[f].decode(errors="replace") for f in (proc.stdout, proc.stderr))
        if seen(out, err) or proc.poll() is not None:
            alive = proc.poll() is None
            if alive:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            return alive, out, err
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    return False, "", "timed out before the fault"


def kill_after(proc: subprocess.Popen, seconds: float) -> bool:
    """SIGKILLs the child after `seconds`; whether it was still running then."""
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# -- the database after a fault -------------------------------------------------------------------
def inspect(db: Path, o: Outcome) -> dict:
    """Opens `db` read-write without waiting and checks it: every run whole, nothing left behind.
    Returns {run_id: run} and the controller versions."""
    from store import Store

    leftovers = [p.name for p in db.parent.iterdir() if p.name.endswith(".tmp") or ".tmp" in p.suffixes]
    staged = db.parent / f"{db.name}.staging"
    o.check("no temporary file left", not leftovers, ", ".join(leftovers))
    try:
        with Store(db, wait_s=0.0) as st:
            o.check("opens read-write at once", not st.staged, st.message)
            o.check("nothing staged left", not (staged.exists() and any(staged.iterdir())))
            runs = st.runs()
            steps = st.steps()
            emitted = steps.groupby("run_id")["emitted"].sum().to_dict() if len(steps) else {}
            broken = [r["run_id"] for r in runs.to_dict("records") if emitted.get(r["run_id"], 0) != (r["n_tokens"] or 0)]
            o.check("every run whole", not broken, f"{len(broken)} run(s) with missing steps")
            ctl = st.controllers()
            versions = sorted({int(v) for v in ctl["version"]}) if len(ctl) else []  # one version spans its models
            return {"runs": {r["run_id"]: r for r in runs.to_dict("records")}, "versions": versions,
                    "traces": len(st.traces())}
    except Exception as e:  # noqa: BLE001 - any failure to open is the finding
        o.check("opens read-write at once", False, last_line(str(e)))
        return {"runs": {}, "versions": [], "traces": 0}


# -- the faults -----------------------------------------------------------------------------------
def stored_before(db: Path, o: Outcome) -> dict:
    """A run in `db` before the fault (written here: which process made it does not matter)."""
    from store import Store

    with Store(db) as st:
        st.add_run(dict(target="earlier", draft="earlier", target_tier="fp32", policy="ar", prompt="stored before",
                        n_tokens=0, n_steps=0, config={}))
    return inspect(db, o)["runs"]


def sweep_killed(model: list[str], work: Path, per_task: int, max_new: int) -> Outcome:
    o, db = Outcome("sweep killed"), work / "sweep.duckdb"
    args = ["profile", *model, "--policies", SWEEP_POLICIES, "--prompts", "heldout", "--per-task", str(per_task),
            "--max-new-tokens", str(max_new), "--sweep", "s"]
    done = re.compile(r"(\d+)/(\d+)")

    def two_stored(out: str, err: str) -> bool:
        counts = [(int(a), int(b)) for a, b in done.findall(err)]
        return bool(counts) and counts[-1][0] >= 2

    o.injected, _, err = kill_when(cli(args, db), two_stored)
    counts = [(int(a), int(b)) for a, b in done.findall(err)]
    finished, total = counts[-1] if counts else (0, 0)
    o.injected = o.injected and 0 < finished < total
    before = inspect(db, o)["runs"]
    o.lost = max(0, finished - len(before))  # tqdm counts a cell once it is stored
    rc, out, err = finish(cli(args, db))
    after = inspect(db, o)["runs"]
    cells = [(r["prompt"], r["policy"]) for r in after.values() if r.get("sweep") == "s"]
    o.lost += len(set(before) - set(after))
    o.resumed = rc == 0 and len(cells) == total == len(set(cells))
    o.line = f"{len(before)} of {total} cells stored at the kill; the rerun stored {len(after) - len(before)} more, each cell once"
    return o


def decode_killed(model: list[str], work: Path, max_new: int) -> Outcome:
    o, db = Outcome("decode killed"), work / "decode.duckdb"
    first = stored_before(db, o)
    proc = cli(["generate", *model, "--prompt", "Write a long story about a lighthouse keeper.", "--chat",
                "--policy", "ar", "--max-new-tokens", str(max_new)], db)
    o.injected, _, _ = kill_when(proc, lambda out, err: len(out) >= 8)  # it streams text: the decode is under way
    mid = inspect(db, o)["runs"]
    o.lost = len(set(first) - set(mid))
    o.check("the killed decode stored nothing half-made", set(mid) == set(first))
    rc, _, err = finish(cli(["generate", *model, "--prompt", "Hello again", "--max-new-tokens", "8"], db))
    after = inspect(db, o)["runs"]
    o.resumed = rc == 0 and len(after) == len(mid) + 1
    o.line = last_line(err) if rc else f"{len(first)} run before, {len(after)} after the next decode"
    return o


def retrain_killed(work: Path) -> Outcome:
    from engine.datasets.speckv_csv import import_speckv
    from store import Store

    o, db = Outcome("retrain killed"), work / "retrain.duckdb"
    with Store(db) as st:  # the runs it retrains from (SpecKV's phase-2 steps: no model needed)
        import_speckv(st, SPECKV_CSV)
    t0 = time.monotonic()
    rc, _, err = finish(cli(["retrain", "--source", "speckv", "--activate"], db))
    full_s = time.monotonic() - t0
    before = inspect(db, o)
    o.check("a version stored before", rc == 0 and before["versions"] == [1], last_line(err))
    o.injected = kill_after(cli(["retrain", "--source", "speckv", "--activate"], db), full_s / 2)
    mid = inspect(db, o)
    o.lost = len(set(before["versions"]) - set(mid["versions"])) + len(set(before["runs"]) - set(mid["runs"]))
    o.check("the killed retrain stored no version", mid["versions"] == before["versions"], str(mid["versions"]))
    rc, _, err = finish(cli(["retrain", "--source", "speckv", "--activate"], db))
    after = inspect(db, o)
    o.resumed = rc == 0 and after["versions"] == [1, 2]
    o.line = f"killed at {full_s / 2:.1f} s of a {full_s:.1f} s retrain; versions after: {after['versions']}"
    return o


def disk_full(model: list[str], work: Path) -> Outcome:
    o, db = Outcome("disk full"), work / "full.duckdb"
    first = stored_before(db, o)
    # No file the child writes may pass FULL_BYTES: it loads and decodes (reads), its run's commit cannot land.
    rc, _, err = finish(cli(["generate", *model, "--prompt", "Hello again", "--max-new-tokens", "8"], db, FULL_BYTES))
    o.injected = rc != 0
    o.line = last_line(err)
    errors = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    o.check("one error line, no traceback", "Traceback" not in err and len(errors) == 1, err[-300:])
    o.line = errors[0] if errors else o.line
    mid = inspect(db, o)["runs"]
    o.lost = len(set(first) - set(mid))
    rc, _, err = finish(cli(["generate", *model, "--prompt", "Hello again", "--max-new-tokens", "8"], db))
    o.resumed = rc == 0 and len(inspect(db, o)["runs"]) == len(mid) + 1
    return o


def _model_env(db: Path, model: list[str]) -> dict[str, str]:
    """The workbench's environment on `db` and the model flags' pair (as `make run` reads them)."""
    flags = dict(zip(model[::2], model[1::2]))
    return {"SPECLAB_DB": str(db), "HF_HUB_OFFLINE": "1", "SPECLAB_TARGET": flags.get("--target", ""),
            "SPECLAB_DRAFT": flags.get("--draft", "")}


def _healthy(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def second_server(model: list[str], work: Path) -> Outcome:
    o, db = Outcome("second server"), work / "server.duckdb"
    env = _model_env(db, model)
    port = browser.free_port()
    with browser.app_server(env, port) as url:
        o.check("the first server answers", _healthy(url, START_S))
        second = subprocess.Popen(browser.server_command(port), cwd=REPO, env={**os.environ, **env},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            rc = second.wait(timeout=60)
        except subprocess.TimeoutExpired:
            second.kill()
            rc = None
        text = second.stdout.read().decode(errors="replace")
        o.injected = True
        o.line = next((ln.strip() for ln in text.splitlines() if f"Port {port}" in ln), last_line(text))
        o.check("the second one exits saying the port is taken", rc not in (None, 0) and TAKEN.search(o.line) is not None,
                text[-300:])
        o.resumed = _healthy(url, 10)
    if db.exists():
        inspect(db, o)
    return o


# The Profile page's line once the sweep named "killed" has ended: done/total, and how many were stored before.
SWEEP_ENDED = re.compile(r"Sweep killed: (\d+)/(\d+) done(?: \((\d+) stored before\))?")


# The Profile page's progress has stored at least `n` items ("3/24 runs · …").
SWEEP_DONE = r"""(n) => { const p = document.querySelector('[data-testid="stProgress"]');
    const m = p && p.textContent.match(/(\d+)\/\d+ runs/); return !!m && Number(m[1]) >= n; }"""


def _start_sweep(page, name: str, per_task: int, stored: int = 0) -> None:
    """Profile's Start pressed; returns once its progress shows, and `stored` items are stored."""
    browser.go(page, "Profile", timeout_s=START_S)
    page.get_by_role("textbox", name="Sweep name").fill(name)
    page.get_by_role("spinbutton", name="Prompts per task").fill(str(per_task))
    page.get_by_role("spinbutton", name="Max new tokens").fill("32")
    page.get_by_role("button", name="Start").click()
    page.locator('[data-testid="stProgress"]').first.wait_for(timeout=START_S * 1e3)
    if stored:
        page.wait_for_function(SWEEP_DONE, arg=stored, timeout=START_S * 1e3, polling=browser.POLL_MS)


TRAINING = "Fitting the MLP"  # the Replay & retrain page's line while a retrain runs
TRAINED = re.compile(r"Activate v\d+|anyway, although")  # what it offers once one has ended


def _train(page) -> None:
    """Replay & retrain's Train on the SpecKV import, pressed; returns once the fit has begun."""
    browser.go(page, "Replay & retrain", timeout_s=START_S)
    page.get_by_text("speckv: the SpecKV import", exact=False).first.click()
    browser.wait_idle(page, START_S)
    page.get_by_role("button", name="Train", exact=True).click()
    page.get_by_text(TRAINING).first.wait_for(timeout=START_S * 1e3)


def server_killed(model: list[str], work: Path, per_task: int = 1) -> Outcome:
    """The workbench's server SIGKILLed while its Profile sweep runs, a Live decode streams and a
    retrain fits (three sessions), then started again on the same database: what finished is
    there, nothing half-made, no controller version from the killed retrain; Start on the same
    sweep name runs only the cells left, and Train stores a version."""
    from engine.datasets.speckv_csv import import_speckv
    from store import Store

    o, db = Outcome("server killed"), work / "killed.duckdb"
    with Store(db) as st:  # what the retrain fits on (no model needed)
        import_speckv(st, SPECKV_CSV)
    env = _model_env(db, model)
    procs: list = []
    with browser.app_server(env, procs=procs) as url, browser.chromium_page() as page:
        page.goto(url, wait_until="networkidle")
        page.get_by_role("heading", name="Live decode").wait_for(timeout=START_S * 1e3)
        # Something stored first: the decode below then takes turns with the sweep's steps.
        _start_sweep(page, "killed", per_task, stored=1)
        trainer = page.context.browser.new_page(viewport=page.viewport_size)  # a second session
        trainer.goto(url, wait_until="networkidle")
        browser.go(page, "Live decode", timeout_s=START_S)
        page.get_by_label("…or any policy spec").fill("ar")
        page.get_by_label("Max new tokens").fill("2000")
        page.get_by_role("button", name="Generate").click()
        page.wait_for_function(browser.STREAMED, timeout=START_S * 1e3, polling=browser.POLL_MS)
        _train(trainer)
        training = trainer.get_by_text(TRAINING).count() > 0 and trainer.get_by_text(TRAINED).count() == 0
        o.injected = procs[0].poll() is None and training
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
    seen = inspect(db, o)
    mid = seen["runs"]
    swept = [(r["prompt"], r["policy"]) for r in mid.values() if r.get("sweep") == "killed"]
    finished = seen["traces"] + len(swept)  # the sweep traces its prompts first, then runs its cells
    o.check("the killed decode stored nothing",
            not [r for r in mid.values() if not r.get("sweep") and r.get("source") != "speckv"])
    o.check("the sweep's finished items are there", finished >= 1, "none stored before the kill")
    o.check("the killed retrain stored no version", seen["versions"] == [], str(seen["versions"]))
    with browser.app_server(env) as url, browser.chromium_page() as page:
        page.goto(url, wait_until="networkidle")
        page.get_by_role("heading", name="Live decode").wait_for(timeout=START_S * 1e3)
        _start_sweep(page, "killed", per_task)
        ended = page.get_by_text(SWEEP_ENDED).first  # the Profile page's line once the sweep has ended
        ended.wait_for(timeout=600_000)
        done, total, before = (int(x or 0) for x in SWEEP_ENDED.search(ended.inner_text()).groups())
        browser.wait_idle(page, START_S)
        _train(page)
        page.get_by_text(TRAINED).first.wait_for(timeout=600_000)
        browser.wait_idle(page, START_S)
    final = inspect(db, o)
    after = final["runs"]
    cells = [(r["prompt"], r["policy"]) for r in after.values() if r.get("sweep") == "killed"]
    o.lost = len(set(mid) - set(after))
    o.resumed = done == total and len(cells) == len(set(cells)) and before == finished and final["versions"] == [1]
    o.line = (f"{finished} of the sweep's {total} items (traces, then runs) stored at the kill; after a restart, "
              f"Start on the same name ran the other {total - before}, each cell once; the killed retrain "
              f"stored no version, the next stored versions {final['versions']}")
    return o


FAULTS = ("sweep", "decode", "retrain", "disk", "port", "server")


def measure(model: list[str], work: Path, faults: tuple[str, ...] = FAULTS, per_task: int = 1, max_new: int = 64,
            long_new: int = 512, say: Callable[[str], None] = lambda m: None) -> list[Outcome]:
    runs = {"sweep": lambda: sweep_killed(model, work, per_task, max_new),
            "decode": lambda: decode_killed(model, work, long_new), "retrain": lambda: retrain_killed(work),
            "disk": lambda: disk_full(model, work), "port": lambda: second_server(model, work),
            "server": lambda: server_killed(model, work)}
    out = []
    for name in faults:
        say(f"fault: {name}")
        out.append(runs[name]())
    return out


def report(outcomes: list[Outcome]) -> str:
    lines = [f"{o.fault:15s} {'ok' if o.ok else 'FAILED'}  lost {o.lost}  next action "
             f"{'n/a' if o.resumed is None else 'ok' if o.resumed else 'FAILED'}  checks {len(o.checks)} passed"
             + (f", failed: {'; '.join(o.failed)}" if o.failed else "") + f"\n{'':15s} {o.line}" for o in outcomes]
    lines.append(summary(outcomes))
    return "\n".join(lines)


def summary(outcomes: list[Outcome]) -> str:
    return (f"faults injected {sum(o.injected for o in outcomes)}/{len(outcomes)}, runs lost "
            f"{sum(o.lost for o in outcomes)}, sweeps resumed "
            f"{sum(bool(o.resumed) for o in outcomes if o.fault in ('sweep killed', 'server killed'))}, database checks passed "
            f"{sum(len(o.checks) for o in outcomes)}/{sum(len(o.checks) + len(o.failed) for o in outcomes)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench faults", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="HF id or local dir (default: the embedded model)")
    p.add_argument("--draft", default=None, help="its draft (default: the shipped one)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"which, of {', '.join(FAULTS)}")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    faults = tuple(f for f in a.faults.split(",") if f)
    if bad := [f for f in faults if f not in FAULTS]:
        raise ValueError(f"unknown fault(s) {', '.join(bad)}; known: {', '.join(FAULTS)}")
    model = [*(["--target", a.target] if a.target else []), *(["--draft", a.draft] if a.draft else [])]
    with tempfile.TemporaryDirectory(prefix="speclab-faults-") as tmp:
        outcomes = measure(model, Path(tmp), faults, say=lambda m: print(m, file=sys.stderr, flush=True))
    if a.json:
        print(json.dumps({"faults": [dict(asdict(o), ok=o.ok) for o in outcomes], "summary": summary(outcomes)}))
    else:
        print(report(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
