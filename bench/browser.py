"""The workbench's live decode against the CLI on the same generation, measured in one run:

    `python -m engine generate` (the peer)  vs  the Live decode page in a real Chromium

Both decode the same prompt with the same policy, tier and length on the same models; the page's
figure is the engine's tokens/s while it streams into the browser (the redraws run in this
machine's Chromium and Streamlit server, so they compete with torch exactly as a user's would).
The CLI runs first, on the same database, so a cost table it measures is the page's too; then
CLI and page runs alternate and their medians are compared.

Run: python bench/browser.py [--json] [--policy P] [--max-new-tokens N]
     or python -m engine bench browser
Prints the ratio (≥ 0.8: within 80% of the CLI); never asserts an absolute time."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from engine.datasets.prompts import WORKBENCH_PROMPT as DEFAULT_PROMPT  # the page's default prompt

ROOT = Path(__file__).resolve().parents[1]  # app.py, run by the page's server

CHROMIUM = os.environ.get("SPECLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def browser_missing() -> str | None:
    """Why a real-browser run cannot happen here (one line), or None."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright)"
    if not os.path.exists(CHROMIUM):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium chromium-driver)"
    return None


def default_policy() -> str:
    """The policy a newcomer meets on the Live decode page."""
    from engine.decode.policies import DEFAULT_POLICY

    return DEFAULT_POLICY


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(port: int) -> list[str]:
    """The workbench's server on 127.0.0.1:`port`, as `make run` starts it."""
    return [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.address", "127.0.0.1",
            "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false"]


@contextlib.contextmanager
def app_server(env: dict[str, str], port: int | None = None, timeout_s: float = 120.0,
               procs: list | None = None) -> Iterator[str]:
    """The workbench on 127.0.0.1 (a fresh port), as `make run` starts it; yields its URL (its
    process is appended to `procs`, where given: its memory is read from there)."""
    port = port or free_port()
    cmd = server_command(port)
    log = open(os.environ["SPECLAB_APP_LOG"], "wb") if os.environ.get("SPECLAB_APP_LOG") else tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    if procs is not None:
        procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-400:].replace("\n", " | ")
                raise RuntimeError(f"the app did not start on {url}: {tail}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
        log.close()


@contextlib.contextmanager
def chromium_page(viewport: tuple[int, int] = (1400, 2400)) -> Iterator[object]:
    """A Playwright page in Debian's Chromium (headless, no sandbox, no GPU)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            yield page
        finally:
            browser.close()


# Playwright polls a wait_for_function on every animation frame unless told otherwise: 60 queries a
# second in the page, CPU a user's browser never spends, taken from torch on a small machine.
POLL_MS = 250


def metrics(page) -> dict[str, str]:
    """The page's st.metric tiles, label → value."""
    out = {}
    for tile in page.locator('[data-testid="stMetric"]').all():
        label = tile.locator('[data-testid="stMetricLabel"]').inner_text().strip()
        out[label] = tile.locator('[data-testid="stMetricValue"]').inner_text().strip()
    return out


# Idle: the app's root says no script runs (Streamlit's own e2e tests read this attribute) and the
# status widget is gone. A press or a click starts its run a moment later, and a page's run can end
# with st.rerun(); so idle must hold over several polls in a row, not once after a fixed wait.
IDLE = """() => { const app = document.querySelector('[data-testid="stApp"]');
    return !!app && app.getAttribute('data-test-script-state') === 'notRunning'
        && !document.querySelector('[data-testid="stStatusWidget"]'); }"""
QUIET_POLLS = 3


def wait_idle(page, timeout_s: float) -> None:
    """Until the script run ends and no other starts for QUIET_POLLS polls."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < QUIET_POLLS:
        page.wait_for_timeout(POLL_MS)
        left_ms = max(deadline - time.monotonic(), 0.001) * 1e3
        if page.evaluate(IDLE):
            quiet += 1
            continue
        quiet = 0
        page.wait_for_function(IDLE, timeout=left_ms, polling=POLL_MS)


# The Live page's streamed output once it holds more than its "…" placeholder.
STREAMED = """() => [...document.querySelectorAll('[data-testid="stText"]')].some(e => e.innerText.trim().length > 1)"""


def go(page, title: str, click_s: float = 60.0, timeout_s: float = 600.0) -> None:
    """Open a page from the sidebar's navigation, as a user would, and wait until it is idle."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    heading = page.get_by_role("heading", name=title, exact=True).first
    page.get_by_role("link", name=title, exact=True).click()
    try:
        heading.wait_for(timeout=click_s * 1e3)
    except PlaywrightTimeout:  # a click that lands while a run ends in st.rerun() is dropped: click again
        page.get_by_role("link", name=title, exact=True).click()
        heading.wait_for(timeout=timeout_s * 1e3)
    wait_idle(page, timeout_s)


def open_live(page, url: str, prompt: str, policy: str, max_new: int, timeout_s: float = 600) -> None:
    """The Live decode page with the prompt, policy and length filled in (kept for later presses)."""
    page.goto(url, wait_until="networkidle")
    page.get_by_role("heading", name="Live decode").wait_for(timeout=timeout_s * 1e3)
    page.get_by_label("…or any policy spec").fill(policy)
    page.get_by_label("Max new tokens").fill(str(max_new))
    page.get_by_label("Prompt").fill(prompt)


# The page's "Stored as run <id> …" line (or its staged/not-stored warning): it names each run, so a
# new one tells that this press's generation has ended, whenever Streamlit's status widget shows.
STORED_LINE = """() => [...document.querySelectorAll('[data-testid^="stAlertContent"]')]
    .map(e => e.innerText).find(t => /stored|staged/i.test(t)) || ''"""


def press_generate(page, timeout_s: float = 600) -> dict[str, str]:
    """One generation on the open Live decode page; its metric tiles once that run has ended and
    been stored. Waiting for the status widget alone could return the previous run's tiles: the
    widget can appear after a fixed wait has passed."""
    before = page.evaluate(STORED_LINE)
    page.get_by_role("button", name="Generate").click()
    page.wait_for_function(f"(before) => {{ const t = ({STORED_LINE})(); return t && t !== before; }}",
                           arg=before, timeout=timeout_s * 1e3, polling=POLL_MS)
    wait_idle(page, timeout_s)
    return metrics(page)


def cli_generate(env: dict[str, str], prompt: str, policy: str, max_new: int) -> dict:
    """The peer: `python -m engine generate --json` in a fresh process; its own figure (decode
    only, after loading) is the comparison."""
    cmd = [sys.executable, "-m", "engine", "generate", "--prompt", prompt, "--chat", "--policy", policy,
           "--max-new-tokens", str(max_new), "--json"]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the CLI failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout)


def paired(page, url: str, env: dict[str, str], prompt: str, policy: str, max_new: int, rounds: int = 5) -> dict:
    """Browser against CLI on the same generation, in `rounds` alternating pairs (a CLI run, then a
    page run) after one warm-up of each, compared by their medians. Alternating puts both sides
    under the same drift of this machine's speed; back-to-back blocks did not (on 2 cores one pair
    varies by ±15%). The warm-ups are not counted: the CLI's first run measures the cost table the
    page then shares, the page's first run loads the pair into the app."""
    assert rounds >= 1
    cli_generate(env, prompt, policy, max_new)
    open_live(page, url, prompt, policy, max_new)
    press_generate(page)
    cli, shown = [], []
    for _ in range(rounds):
        cli.append(cli_generate(env, prompt, policy, max_new))
        shown.append(press_generate(page))
    cli_tps = statistics.median(c["tokens_per_s"] for c in cli)
    page_tps = statistics.median(float(m["Tokens/s"]) for m in shown)
    return dict(policy=policy, max_new_tokens=max_new, rounds=rounds, cli_tokens_per_s=cli_tps,
                browser_tokens_per_s=page_tps, ratio=page_tps / cli_tps,
                pairs=[(c["tokens_per_s"], float(m["Tokens/s"])) for c, m in zip(cli, shown)],
                cli_n_tokens=cli[-1]["n_tokens"], cli_tokens_per_step=cli[-1]["tokens_per_step"],
                cli_acceptance=cli[-1]["acceptance_rate"], browser_metrics=shown[-1])


def report(r: dict) -> str:
    """The one-line summary both the bench and the browser test print."""
    pairs = ", ".join(f"{c:.1f}/{b:.1f}" for c, b in r["pairs"])
    return (f"live decode, {r['policy']}, {r['max_new_tokens']} tokens, median of {r['rounds']} alternating runs: "
            f"CLI {r['cli_tokens_per_s']:.1f} tok/s, browser {r['browser_tokens_per_s']:.1f} tok/s "
            f"→ {r['ratio']:.2f}× the CLI (CLI/browser per pair: {pairs})")


def run(prompt: str = DEFAULT_PROMPT, policy: str = "", max_new: int = 64, rounds: int = 5,
        db: str | None = None, env: dict[str, str] | None = None, shots: Path | None = None) -> dict:
    """`paired` on a fresh app and database (a temporary one unless given). policy '' = the page's
    default policy, whichever it is (the one a newcomer meets)."""
    if (why := browser_missing()):
        raise RuntimeError(why)
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(env or {}, SPECLAB_DB=db or str(Path(tmp) / "bench.duckdb"), HF_HUB_OFFLINE="1")
        policy = policy or default_policy()
        with app_server(env) as url, chromium_page() as page:
            r = paired(page, url, env, prompt, policy, max_new, rounds)
            if shots:
                page.screenshot(path=str(shots / "live.png"), full_page=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench browser", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--policy", default="", help="default: the Live decode page's default policy")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="alternating CLI/page pairs, compared by medians")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit("error: --rounds must be at least 1")
    r = run(a.prompt, a.policy, a.max_new_tokens, a.rounds)
    print(json.dumps(r) if a.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
