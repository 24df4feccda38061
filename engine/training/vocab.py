"""`python -m engine vocab`: rank the embedded model's tokens by frequency on real text, for the
reduced-vocabulary draft heads (engine/runtime/vocab_head.py).

Text: the first `conversations` ShareGPT V3 conversations (every turn, through the chat template:
the template's own tokens count too), HumanEval's prompts and solutions, and the draft's training
prompts (distill round 0) with the Python-docs paragraphs it also reads. Any text that contains a
held-out prompt is left out: the bench measures agreement on those. A subsample: ShareGPT has ~90K
conversations; a few thousand rank the frequent ids (the ones a head keeps) the same."""
from __future__ import annotations

import itertools
import time
from typing import Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from engine.runtime.vocab_head import RANK_FILE, rank_tokens


def _sharegpt(n: int) -> Iterator[list[dict]]:
    from engine.datasets.sharegpt import conversations

    return itertools.islice(conversations(min_turns=2), n)


def _humaneval() -> Iterator[str]:
    from engine.datasets.humaneval import problems

    for p in problems():
        yield p["prompt"] + p["canonical_solution"]


def texts(tokenizer, n_conversations: int) -> Iterator[tuple[str, str]]:
    """(source, text) pairs; chat texts already through the template."""
    from engine.datasets import prompts as promptlib

    def chat(msgs: list[dict]) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False)

    for msgs in _sharegpt(n_conversations):
        yield "sharegpt", chat(msgs)
    for t in _humaneval():
        yield "humaneval", t
    for _, p in promptlib.training_prompts():
        yield "train_prompts", chat([{"role": "user", "content": p}])
    for t in promptlib.stdlib_texts():
        yield "train_text", t


def count(tokenizer, n_conversations: int = 4000, batch: int = 256) -> tuple[np.ndarray, dict[str, int]]:
    """Token counts [V] over `texts` minus those holding a held-out prompt; tokens per source."""
    from engine.datasets import prompts as promptlib

    held = [p for _, p in promptlib.heldout()]
    vocab = len(tokenizer)
    counts = np.zeros(vocab, dtype=np.int64)
    per_source: dict[str, int] = {}
    items = ((s, t) for s, t in texts(tokenizer, n_conversations) if not any(h in t for h in held))
    while chunk := list(itertools.islice(items, batch)):
        for (source, _), ids in zip(chunk, tokenizer([t for _, t in chunk], add_special_tokens=False)["input_ids"]):
            counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab)[:vocab]
            per_source[source] = per_source.get(source, 0) + len(ids)
    return counts, per_source


def make(n_conversations: int = 4000, say=print) -> None:
    """Counts, ranks (the tokenizer's special ids first) and writes RANK_FILE."""
    from engine.runtime.models import EMBEDDED_LABEL, load_tokenizer

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(None)
    counts, per_source = count(tokenizer, n_conversations)
    rank = rank_tokens(torch.from_numpy(counts), tokenizer.all_special_ids)
    save_file({"rank": rank.to(torch.int32), "count": torch.from_numpy(counts)}, str(RANK_FILE),
              metadata={"tokenizer": EMBEDDED_LABEL, "sharegpt_conversations": str(n_conversations),
                        "tokens": str(sum(per_source.values())), "made_by": "python -m engine vocab"})
    seen = int((counts > 0).sum())
    say(f"{RANK_FILE.name}: {sum(per_source.values()):,} tokens ({per_source}), {seen:,} of {len(counts):,} ids seen, "
        f"{time.perf_counter() - t0:.0f} s")
