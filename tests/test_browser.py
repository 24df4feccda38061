"""The workbench in a real browser: Debian's Chromium, driven by Playwright, against the app as
`make run` starts it (127.0.0.1), on the embedded pair and a fresh database. One newcomer's
session: live decode (its tokens/s measured against the CLI's on the same generation), a
comparison, a short profile sweep, a retrain and an export. Screenshots go to docs/screenshots/
(the README shows them)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from bench import browser as B  # the server, the browser and the CLI peer

ROOT = Path(__file__).resolve().parents[1]

SHOTS = ROOT / "docs" / "screenshots"
TIMEOUT_MS = 600_000
CLICK_MS = 60_000  # a page's heading shows within seconds of its link's click
# Browser / CLI tokens/s (medians of alternating runs) below which the page, not the machine, is at
# fault. The bar is 0.8; `bench browser` prints the figure (0.80 and 0.88 in the last two runs
# here, the machine's own speed moving by a quarter between runs), so the test asserts the floor that
# catches the kind of bug the page had (Streamlit's file watcher: 0.23; a racy press: 0.28).
FLOOR = 0.6
# Alternating CLI/page pairs (`bench browser` takes 5): each CLI run is a process that loads the
# pair (~25 s here), and the floor sits far enough below the ratio measured that 3 pairs' median shows it.
ROUNDS = 3

pytestmark = pytest.mark.slow

if (why := B.browser_missing()):
    pytest.skip(f"no real-browser test here: {why}", allow_module_level=True)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """(page, url, env): one app server and one Chromium tab for the whole walk-through."""
    db = tmp_path_factory.mktemp("browser") / "speclab.duckdb"
    env = {"SPECLAB_DB": str(db), "SPECLAB_TARGET": "", "SPECLAB_DRAFT": "", "HF_HUB_OFFLINE": "1"}
    SHOTS.mkdir(parents=True, exist_ok=True)
    with B.app_server(env) as url, B.chromium_page() as page:
        yield page, url, env


def _go(page, url: str, title: str) -> None:
    B.go(page, title, CLICK_MS / 1e3, TIMEOUT_MS / 1e3)


def _no_error(page) -> None:
    errors = page.locator('[data-testid="stException"]')
    assert errors.count() == 0, errors.first.inner_text()
    alerts = [a.inner_text() for a in page.locator('[data-testid="stAlertContentError"]').all()]
    assert not alerts, alerts


# The bars for a newcomer's first Generate here, with nothing else running (printed; the
# assertions allow twice as much: another test file may run beside this one under `make test`).
FIRST_TOKENS_S, FIRST_RUN_S = 15, 60


def _stored_after(page, before: str, timeout_s: float) -> None:
    page.wait_for_function(f"(before) => {{ const t = ({B.STORED_LINE})(); return t && t !== before; }}",
                           arg=before, timeout=timeout_s * 1e3, polling=B.POLL_MS)


def test_a_newcomers_first_generate_starts_at_once_and_stop_stops(session):
    """A fresh database, the page's defaults (rakv, fp32): the first tokens show within seconds (the
    policy reads probed costs; the table is measured after the run, in the background), Stop ends a
    long run within a step and the run is shown and stored, and the KV page shows its controls."""
    page, url, _ = session
    page.goto(url, wait_until="networkidle")
    page.get_by_role("heading", name="Live decode").wait_for(timeout=TIMEOUT_MS)
    t0 = time.monotonic()
    page.get_by_role("button", name="Generate").click()
    page.wait_for_function(B.STREAMED, timeout=TIMEOUT_MS, polling=B.POLL_MS)
    first = time.monotonic() - t0
    _stored_after(page, "", TIMEOUT_MS / 1e3)
    done = time.monotonic() - t0
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    shown = B.metrics(page)
    print(f"\nfirst Generate on a fresh database (rakv, fp32, 64 tokens): first tokens shown after {first:.1f} s, "
          f"run shown and stored after {done:.1f} s ({shown.get('Tokens/s')} tok/s)")
    assert first <= 2 * FIRST_TOKENS_S and done <= 2 * FIRST_RUN_S, (first, done)
    # The table is measured after the run; the next runs read it. Waiting here keeps that
    # measurement out of the timed comparisons that follow.
    page.get_by_text("cost table measured for", exact=False).first.wait_for(timeout=TIMEOUT_MS)
    # Stop: a long run, stopped after its first steps, is shown and stored as stopped.
    page.get_by_label("…or any policy spec").fill("fixed:1")
    page.get_by_label("Max new tokens").fill("200")
    before = page.evaluate(B.STORED_LINE)
    page.get_by_role("button", name="Generate").click()
    # Any step's status line: on a fast CPU the line drawn each second may be past step 3 already.
    page.get_by_text(re.compile(r"· step [1-9]\d* ·")).first.wait_for(timeout=TIMEOUT_MS)
    t_stop = time.monotonic()
    page.get_by_test_id("stButton").get_by_role("button", name="Stop").click()  # the page's, not the header's
    _stored_after(page, before, TIMEOUT_MS / 1e3)
    stopped = time.monotonic() - t_stop
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    shown = B.metrics(page)
    print(f"Stop: the run shown and stored {stopped:.1f} s after the click")
    assert shown["Stop reason"] == "stopped", shown
    # The KV page shows its controls before any measurement.
    _go(page, url, "KV & prefetch")
    _no_error(page)
    page.get_by_role("button").first.wait_for(timeout=CLICK_MS)
    assert page.locator('[data-testid="stSelectbox"], [data-testid="stNumberInput"]').count() >= 2


# The generation both sides decode: a fixed γ, so that both make the same steps. `rakv` reads
# the acceptance of the runs stored so far, so the CLI's runs change what the page's run decides
# (one measurement compared 1.00 tokens/step in the page with 2.86 in the CLI).
SAME = "fixed:4"


def test_live_decode_in_the_browser_keeps_up_with_the_cli(session):
    page, url, env = session
    # Same generation, same machine, CLI and page runs alternating: the page must not make the
    # engine look slower than it is.
    r = B.paired(page, url, env, B.DEFAULT_PROMPT, SAME, 64, rounds=ROUNDS)
    print("\n" + B.report(r))
    shown = r["browser_metrics"]
    assert float(shown["Tokens/step"]) == round(r["cli_tokens_per_step"], 2), (shown, r["cli_tokens_per_step"])
    _no_error(page)
    page.locator('[data-testid="stVegaLiteChart"]').first.wait_for(timeout=TIMEOUT_MS)  # the step charts
    page.locator('[data-testid="stDataFrame"]').first.wait_for(timeout=TIMEOUT_MS)  # the step table
    page.wait_for_timeout(2000)  # Vega draws after the element appears
    page.screenshot(path=str(SHOTS / "live.png"), full_page=True)
    assert r["ratio"] >= FLOOR, r
    assert shown["Stop reason"] in {"EOS", "max tokens"}


def test_compare_two_policies(session):
    page, url, _ = session
    _go(page, url, "Compare")
    page.get_by_role("button", name="Compare").click()
    page.get_by_text("identical", exact=False).first.wait_for(timeout=TIMEOUT_MS)
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    assert page.locator('[data-testid="stVegaLiteChart"]').count() >= 1  # the γ timelines
    assert page.locator('[data-testid="stDataFrame"]').count() >= 1  # the summary table
    page.screenshot(path=str(SHOTS / "compare.png"), full_page=True)


def test_profile_sweep_runs_in_the_background(session):
    page, url, _ = session
    _go(page, url, "Profile")
    page.get_by_label("Max new tokens").fill("8")
    page.get_by_role("button", name="Start").click()
    page.locator('[data-testid="stProgress"]').first.wait_for(timeout=TIMEOUT_MS)
    page.screenshot(path=str(SHOTS / "profile-running.png"), full_page=True)
    # The page stays usable while the sweep runs: another page opens and answers.
    _go(page, url, "Runs")
    _no_error(page)
    _go(page, url, "Profile")  # coming back shows its progress, then its table when it ends
    page.locator('[data-testid="stDataFrame"]').first.wait_for(timeout=TIMEOUT_MS)
    _no_error(page)
    page.screenshot(path=str(SHOTS / "profile.png"), full_page=True)


def test_retrain_from_the_sweeps_traces(session):
    page, url, _ = session
    _go(page, url, "Replay & retrain")
    page.get_by_role("button", name="Train").click()
    # A version no worse than what it would replace is offered at once; a worse one (a short sweep's
    # few traces often give one) only behind a tick that says why.
    offered = page.get_by_role("button", name="Activate").or_(page.get_by_text("anyway, although", exact=False))
    offered.first.wait_for(timeout=TIMEOUT_MS)
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    assert page.locator('[data-testid="stDataFrame"]').count() >= 2  # side by side, new vs active
    held_back = page.get_by_text("anyway, although", exact=False)
    if held_back.count():
        held_back.first.click()
        B.wait_idle(page, TIMEOUT_MS / 1e3)
    page.get_by_role("button", name="Activate").first.click()
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    page.screenshot(path=str(SHOTS / "retrain.png"), full_page=True)


def test_runs_page_plots_and_downloads(session):
    page, url, _ = session
    _go(page, url, "Runs")
    _no_error(page)
    page.locator('[data-testid="stDataFrame"]').first.wait_for(timeout=TIMEOUT_MS)  # the runs tab first
    with page.expect_download(timeout=TIMEOUT_MS) as dl:
        page.get_by_role("button", name="Runs (CSV)", exact=True).click()
    assert dl.value.suggested_filename.endswith(".csv")
    charts = page.locator('[data-testid="stVegaLiteChart"]')
    for tab in ("Best γ", "Tokens/s by policy", "Acceptance"):  # each tab draws its figure when opened
        page.get_by_role("tab", name=tab, exact=True).click()
        charts.first.wait_for(timeout=TIMEOUT_MS)
        B.wait_idle(page, TIMEOUT_MS / 1e3)
        _no_error(page)
        assert charts.count() == 1
    page.screenshot(path=str(SHOTS / "runs.png"), full_page=True)


def test_export_writes_a_config_generate_reads_back(session, tmp_path):
    page, url, env = session
    _go(page, url, "Export")
    _no_error(page)
    with page.expect_download(timeout=TIMEOUT_MS) as dl:
        page.get_by_role("button", name="JSON").first.click()
    path = tmp_path / dl.value.suggested_filename
    dl.value.save_as(path)
    config = json.loads(path.read_text())
    assert config["policy"]
    page.screenshot(path=str(SHOTS / "export.png"), full_page=True)


def test_live_decode_on_the_llama_cpp_engine(session):
    """The sidebar's Engine set to llama.cpp: the Live page decodes on the shipped Q4_1 (its first
    GGUF format) through llama.cpp, the run shown, labelled with the format, and stored, no error."""
    page, url, _ = session
    page.goto(url, wait_until="networkidle")  # a fresh session on the Live page
    page.get_by_role("heading", name="Live decode").wait_for(timeout=TIMEOUT_MS)
    page.locator('[data-testid="stSelectbox"]').filter(has_text="Engine").click()
    page.get_by_role("option", name="llamacpp", exact=True).click()
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    page.get_by_label("…or any policy spec").fill("fixed:3@draft")
    page.get_by_label("Max new tokens").fill("16")
    before = page.evaluate(B.STORED_LINE)
    page.get_by_role("button", name="Generate").click()
    _stored_after(page, before, TIMEOUT_MS / 1e3)
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    page.get_by_text("(q4_1, KV native", exact=False).first.wait_for(timeout=CLICK_MS)  # the run's label
    assert B.metrics(page)["Stop reason"] in {"EOS", "max tokens"}
