"""The one exception type callers of the store need to catch."""

from __future__ import annotations


class StoreError(Exception):
    """A problem the user can fix (bad input, unusable file); str() is always one line."""

    def __init__(self, message: str) -> None:
        # Messages end up in a single UI status line and in logs grepped by line.
        super().__init__(" ".join(str(message).split()))
