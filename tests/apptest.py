"""What every AppTest of the workbench shares: the app's path, the navigation-mode fix, an
environment on the tiny test models with a fresh database, and small readers."""
from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[1] / "app.py"  # AppTest resolves relative paths oddly


@pytest.fixture(autouse=True)
def _navigation_mode(monkeypatch):
    """AppTest resets PagesManager.uses_pages_directory to None before every run, so with a
    `pages/` folder beside app.py each rerun takes Streamlit's MPA-v1 path and executes the
    page file alone, skipping app.py (and its sidebar). A real server sets the flag to False
    for good once st.navigation has run; do the same here."""
    from streamlit.runtime.pages_manager import PagesManager

    init = PagesManager.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        PagesManager.uses_pages_directory = False

    monkeypatch.setattr(PagesManager, "__init__", patched)


@pytest.fixture
def app_env(tiny_dirs, tmp_path, monkeypatch) -> Path:
    target, draft = tiny_dirs
    db = tmp_path / "ui.duckdb"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECLAB_TARGET", str(target))
    monkeypatch.setenv("SPECLAB_DRAFT", str(draft))
    monkeypatch.setenv("SPECLAB_DB", str(db))
    return db


def _app() -> AppTest:
    """The app on its default page, run once."""
    at = AppTest.from_file(str(APP), default_timeout=60)
    return at.run()


def _errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


