"""Glue shared by the pages (not a page itself): settings from the sidebar and the environment,
the cached model pair, error display and storing a run. No decoding math here."""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import streamlit as st

from engine.base.helpers import default_db, one_line
from engine.base.names import EMBEDDED_LABEL, ENGINES
from engine.service import SUFFIX_BUDGET, SuffixHistory
from engine.service.session import device_label, load_for_turns, shared_prefix_cache

_KEYS = {"target": "speclab_target", "draft": "speclab_draft", "db": "speclab_db", "engine": "speclab_engine"}
_ENV = {"target": "SPECLAB_TARGET", "draft": "SPECLAB_DRAFT", "engine": "SPECLAB_ENGINE"}


@dataclass(frozen=True)
class Settings:
    target: str | None  # None = the embedded pair
    draft: str | None  # None = the engine's default draft for the target
    db: str
    engine: str = "torch"  # what runs the target: torch, or llama.cpp on a GGUF (its tiers are formats)


def engine_key(key: str, engine: str) -> str:
    """A tier widget's key on `engine`: llama.cpp's widgets keep keys of their own, since a torch
    tier is not a GGUF format (a value kept under the other engine's key would not be an option)."""
    return key + ("_llamacpp" if engine == "llamacpp" else "")


def _env(name: str) -> str:
    return default_db() if name == "db" else os.environ.get(_ENV[name], "")


# No animations or transitions on any page. The workbench's browser often shares the CPU with the
# decode it shows (a laptop's `make run`), and with no GPU to draw them a page's "running" icon and
# fades are redrawn in software every frame while it waits on a decode: a few waiting pages took a
# core from the decode (docs/benchmarks.md, bench load).
CALM_CSS = "<style>*, *::before, *::after { animation: none !important; transition: none !important; }</style>"


def sidebar() -> None:
    """The sidebar shared by every page (called from app.py): model sources and the database, and
    the page style without animations (CALM_CSS)."""
    st.html(CALM_CSS)
    with st.sidebar:
        st.subheader("Models")
        st.text_input(
            "Target", value=_env("target"), key=_KEYS["target"],
            placeholder=f"embedded ({EMBEDDED_LABEL})",
            help="A local model directory or a Hugging Face id in the local cache. "
                 "Empty: the embedded model (env SPECLAB_TARGET).",
        )
        st.text_input(
            "Draft", value=_env("draft"), key=_KEYS["draft"], placeholder="engine default",
            help="Must share the target's tokenizer. Empty: the engine's default draft "
                 "(env SPECLAB_DRAFT).",
        )
        env_engine = _env("engine") if _env("engine") in ENGINES else "torch"
        st.selectbox(
            "Engine", ENGINES, index=ENGINES.index(env_engine), key=_KEYS["engine"],
            help="What runs the target: torch (transformers), or llamacpp (the target's GGUF through "
                 "llama.cpp; its tiers are GGUF formats, its KV tiers llama.cpp's cache types). "
                 "Env SPECLAB_ENGINE.",
        )
        st.text_input(
            "Database", value=_env("db"), key=_KEYS["db"],
            help="DuckDB file that keeps every run (env SPECLAB_DB).",
        )
        try:
            st.caption(f"Device: {device_label()}")
        except Exception as e:  # noqa: BLE001 - the sidebar must never break the page
            show_error(e)


def settings() -> Settings:
    """Current settings: the sidebar's values, else the environment's."""
    def value(name: str) -> str:
        v = st.session_state.get(_KEYS[name])
        return (_env(name) if v is None else v).strip()

    engine = value("engine") or "torch"
    return Settings(target=value("target") or None, draft=value("draft") or None,
                    db=value("db") or default_db(), engine=engine if engine in ENGINES else "torch")


def show_error(e: BaseException) -> None:
    """One line, never a traceback: user-input errors as their message, others with their type."""
    st.error(one_line(e))


@st.cache_resource(show_spinner=False, max_entries=2)
def _pair(target: str | None, draft: str | None, target_tier: str, engine: str = "torch"):
    pair = load_for_turns(target, draft, target_tier, engine)
    freeze_long_lived()
    return pair


def freeze_long_lived() -> None:
    """The imports and the loaded pairs live as long as the server: frozen, Python's full
    collections walk only what the pages make since, not the half a million objects these hold,
    while holding the GIL that the decode and every page share. Unfrozen and collected first, so
    that a pair evicted from the cache since the last load is not kept for good."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@st.cache_resource(show_spinner=False, max_entries=4)
def _prefix_cache(target: str | None, draft: str | None, target_tier: str, budget_mib: int):
    return shared_prefix_cache(budget_mib * 2**20)


def get_prefix_cache(s: Settings, target_tier: str, budget_mib: int):
    """The cross-request prefix cache of a loaded pair, shared by every session of the process
    (one per budget: changing the budget starts an empty cache)."""
    return _prefix_cache(s.target, s.draft, target_tier, budget_mib)


@st.cache_resource(show_spinner=False, max_entries=2)
def _suffix_history(target: str | None, draft: str | None) -> SuffixHistory:
    return SuffixHistory(SUFFIX_BUDGET)


def get_suffix_history(s: Settings) -> SuffixHistory:
    """The cross-request history of the suffix proposer for a pair (its tokenizer's: one for
    every tier), shared by every session of the process and fed by each live run and comparison."""
    return _suffix_history(s.target, s.draft)


def get_pair(s: Settings, target_tier: str):
    """The model pair, loaded once per (target, draft, target tier, engine) for the whole process.
    Raises the engine's ValueError for bad sources/tiers (errors are not cached)."""
    label = f"{s.target or EMBEDDED_LABEL} + {s.draft or 'default draft'} ({target_tier}, {s.engine})"
    with st.spinner(f"Loading {label}…"):
        return _pair(s.target, s.draft, target_tier, s.engine)
