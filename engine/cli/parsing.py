"""The CLI's plumbing: the command registry (`@command`), one-line usage errors, and the helpers
every command shares (loading a pair, a progress bar, failing early on a bad database)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Iterator

from engine.base.flags import exact_verify

REPO_ROOT = Path(__file__).resolve().parents[2]
TIERS_ARG = ("--tiers", dict(default=None, help="comma-separated target tiers (default: fp32; q4_1 on "
                                               "--engine llamacpp)"))
JSON_ARG = ("--json", dict(action="store_true", help="print JSON instead of text"))
PROMPTS_ARG = ("--prompts", dict(default="heldout", help="prompt set: heldout, bench or train"))


class UsageError(ValueError):
    """Bad command-line arguments (argparse's errors, made one line)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage + exit; we want one line
        raise UsageError(f"{self.prog}: {message}")


# name → (help, the function, its arguments as (flag, add_argument kwargs), model args?, db help)
COMMANDS: dict[str, tuple[str, Callable, list, bool, str | None]] = {}


def command(name: str, help: str, *args: tuple, models: bool = False, db: str | None = None):
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable:
        COMMANDS[name] = (help, fn, list(args), models, db)
        return fn
    return register


def say(message: str) -> None:
    print(message, file=sys.stderr)


def load(a: argparse.Namespace, tier: str, progress: Callable[[str], None] = say):
    from engine.runtime.models import load_pair

    return load_pair(a.target, a.draft, tier, a.draft_tier, a.device, a.trust_remote_code, progress=progress,
                     exact_verify=exact_verify(a), eagle=getattr(a, "eagle", None), engine=getattr(a, "engine", "torch"))


def pairs(a: argparse.Namespace, tiers: list[str]) -> Iterator:
    """The pair at each tier, loaded when the caller gets to it."""
    for tier in tiers:
        yield load(a, tier)


def progress_bar(desc: str, unit: str = "run"):
    from tqdm import tqdm

    return tqdm(total=0, desc=desc, unit=unit, file=sys.stderr)


def open_or_fail(db: str) -> None:
    """A corrupt or locked file fails now, not after minutes of work; released at once."""
    if db:
        from store import Store

        with Store(db, wait_s=0.0):
            pass
