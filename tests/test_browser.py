"""The workbench in a real browser: Debian's Chromium, driven by Playwright, against the app as
`make run` starts it (127.0.0.1), on the embedded pair and a fresh database. One newcomer's
session: live decode (its tokens/s measured against the CLI's on the same generation), a
comparison, a short profile sweep, a retrain and an export. Screenshots go to docs/screenshots/
(the README shows them)."""
from __future__ import annotations

import json
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

from playwright.sync_api import TimeoutError as PlaywrightTimeout  # noqa: E402 - installed, as checked above


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """(page, url, env): one app server and one Chromium tab for the whole walk-through."""
    db = tmp_path_factory.mktemp("browser") / "speclab.duckdb"
    env = {"SPECLAB_DB": str(db), "SPECLAB_TARGET": "", "SPECLAB_DRAFT": "", "HF_HUB_OFFLINE": "1"}
    SHOTS.mkdir(parents=True, exist_ok=True)
    with B.app_server(env) as url, B.chromium_page() as page:
        yield page, url, env


def _go(page, url: str, title: str) -> None:
    """Open a page from the sidebar's navigation, as a user would."""
    heading = page.get_by_role("heading", name=title, exact=True).first
    page.get_by_role("link", name=title, exact=True).click()
    try:
        heading.wait_for(timeout=CLICK_MS)
    except PlaywrightTimeout:  # a click that lands while a run ends in st.rerun() is dropped: click again
        page.get_by_role("link", name=title, exact=True).click()
        heading.wait_for(timeout=TIMEOUT_MS)
    B.wait_idle(page, TIMEOUT_MS / 1e3)


def _no_error(page) -> None:
    errors = page.locator('[data-testid="stException"]')
    assert errors.count() == 0, errors.first.inner_text()
    alerts = [a.inner_text() for a in page.locator('[data-testid="stAlertContentError"]').all()]
    assert not alerts, alerts


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
    page.locator('[data-testid="stPlotlyChart"]').first.wait_for(timeout=TIMEOUT_MS)  # the step charts
    page.locator('[data-testid="stDataFrame"]').first.wait_for(timeout=TIMEOUT_MS)  # the step table
    page.wait_for_timeout(2000)  # plotly draws after the element appears
    page.screenshot(path=str(SHOTS / "live.png"), full_page=True)
    assert r["ratio"] >= FLOOR, r
    assert shown["Stop reason"] in {"eos", "max_new_tokens"}


def test_compare_two_policies(session):
    page, url, _ = session
    _go(page, url, "Compare")
    page.get_by_role("button", name="Compare").click()
    page.get_by_text("identical", exact=False).first.wait_for(timeout=TIMEOUT_MS)
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    assert page.locator('[data-testid="stPlotlyChart"]').count() >= 1  # the γ timelines
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
    page.get_by_role("button", name="Activate").first.wait_for(timeout=TIMEOUT_MS)
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    assert page.locator('[data-testid="stDataFrame"]').count() >= 2  # side by side, new vs active
    page.get_by_role("button", name="Activate").first.click()
    B.wait_idle(page, TIMEOUT_MS / 1e3)
    _no_error(page)
    page.screenshot(path=str(SHOTS / "retrain.png"), full_page=True)


def test_runs_page_plots_and_downloads(session):
    page, url, _ = session
    _go(page, url, "Runs")
    _no_error(page)
    charts = page.locator('[data-testid="stPlotlyChart"]')
    charts.nth(1).wait_for(timeout=TIMEOUT_MS)  # they draw after the page's heading and the store's read
    assert charts.count() >= 2
    with page.expect_download(timeout=TIMEOUT_MS) as dl:
        page.get_by_role("button", name="Runs (CSV)", exact=True).click()
    assert dl.value.suggested_filename.endswith(".csv")
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
