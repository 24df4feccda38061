"""The one exception type callers of the store need to catch, and the one-line error formatter
every layer uses (the CLI's stderr, a page's st.error, the store's own messages)."""

from __future__ import annotations

import re


class StoreError(Exception):
    """A problem the user can fix (bad input, unusable file); str() is always one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def one_line(e: BaseException | str, limit: int = 300) -> str:
    """An error (or any text) on one line: a user error (ValueError, StoreError) as its message,
    anything else prefixed with its type, so that a bug still says what it was."""
    text = " ".join(str(e).split())
    if isinstance(e, BaseException) and not isinstance(e, (ValueError, StoreError)):
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def reason(exc: BaseException) -> str:
    """The cause inside a store message: a library error's first line without its 'IO Error:'
    style prefix."""
    text = str(exc).strip()
    return one_line(re.sub(r"^[A-Za-z ]*Error: ", "", text.splitlines()[0]) if text else type(exc).__name__, 160)
