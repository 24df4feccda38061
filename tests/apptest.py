"""What every AppTest of the workbench shares: the app's path, an environment on the tiny test
models with a fresh database, and small readers."""
from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[1] / "app.py"  # AppTest resolves relative paths oddly


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


