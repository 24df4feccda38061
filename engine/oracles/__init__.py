"""The two oracles the step loop (decode/step.py) walks: proposers and verifiers backed by live
models (draft.py: the draft model; target.py: the target's verifier; eagle.py) or by counts of
the text itself (ngram.py, suffix.py: no model), or by stored acceptance traces (trace.py); the
verification math apart from every proposer (sampling.py: greedy acceptance, rejection sampling).

`PROPOSERS` builds a run's proposers by name (docs/architecture.md, "Oracles"); each factory
imports its class only when called, so that this package (which trace.py and replay import)
stays free of torch.

May import: engine.base, engine.decode, engine.runtime."""
from __future__ import annotations

from typing import Callable

from engine.decode.records import PROPOSER_NAMES

# factory(pair, prompt_ids, sampler, verifier, options as written in the policy spec, the
# cross-request suffix history the run reads or None) → Proposer
Factory = Callable[[object, list[int], object, object, dict[str, str], object], object]


def draft_head(pair, options: dict[str, str] | None = None):
    """The LM head the draft proposer reads through: the sub-head `@draft:vocab=K` names, else the
    pair's default (the embedded draft's 8,192 most frequent tokens); None for the full head."""
    from engine.runtime.vocab_head import sub_head

    k = int(options["vocab"]) if options and "vocab" in options else getattr(pair, "draft_vocab", 0)
    return sub_head(pair, k) if k and k != pair.vocab_size else None  # K = V: the full head itself


def _draft(pair, prompt_ids: list[int], sampler, verifier, options: dict[str, str], history=None):
    from engine.oracles.draft import DraftModelProposer

    return DraftModelProposer(pair, prompt_ids, sampler, lambda: verifier.hit, draft_head(pair, options))


def _no_eagle(pair) -> str:
    return (f"the pair has no EAGLE head ({pair.target_name} was loaded without one; "
            "`python -m engine distill --kind eagle` makes one)")


def _eagle(pair, prompt_ids: list[int], sampler, verifier, options: dict[str, str], history=None):
    if getattr(pair, "eagle", None) is None:
        raise ValueError(_no_eagle(pair))
    from engine.oracles.eagle import EagleProposer

    return EagleProposer(pair, prompt_ids, sampler, verifier)


def _ngram(pair, prompt_ids: list[int], sampler, verifier, options: dict[str, str], history=None):
    from engine.oracles.ngram import NgramProposer

    return NgramProposer.from_options(prompt_ids, sampler, pair.vocab_size, options)


def _suffix(pair, prompt_ids: list[int], sampler, verifier, options: dict[str, str], history=None):
    from engine.oracles.suffix import SuffixProposer

    return SuffixProposer.from_options(prompt_ids, sampler, pair.vocab_size, options, history)


PROPOSERS: dict[str, Factory] = {"draft": _draft, "eagle": _eagle, "ngram": _ngram, "suffix": _suffix}
assert tuple(PROPOSERS) == PROPOSER_NAMES, "engine/decode/records.py lists the proposers in this order"


def available(pair) -> tuple[str, ...]:
    """The proposers `pair` can run, in the canonical order: the draft model, its EAGLE head
    when one is loaded, the n-gram lookup, the suffix counts."""
    return tuple(n for n in PROPOSERS if n != "eagle" or getattr(pair, "eagle", None) is not None)


def check_proposers(pair, names: tuple[str, ...] | None) -> tuple[str, ...]:
    """`names` (None: every one available) in the canonical order; ValueError in one line for
    a proposer the pair cannot run."""
    have = available(pair)
    if names is None:
        return have
    missing = [n for n in names if n not in have]
    if "eagle" in missing:
        raise ValueError(_no_eagle(pair))
    if missing:
        raise ValueError(f"unknown proposer(s) {', '.join(missing)}; this pair has: {', '.join(have)}")
    return tuple(n for n in PROPOSERS if n in names)


def target_verifier(pair, prompt_ids: list[int], sampler, prefix=None, kv_tier: str = "native"):
    """The verifier of `pair`'s target on its engine: torch's (target.py, with the prefix cache) or
    llama.cpp's (llama_target.py, which keeps none across requests)."""
    if getattr(pair, "engine", "torch") == "llamacpp":
        from engine.oracles.llama_target import LlamaTargetVerifier

        return LlamaTargetVerifier(pair, prompt_ids, sampler, kv_tier)
    from engine.oracles.target import TargetVerifier

    return TargetVerifier(pair, prompt_ids, sampler, prefix, kv_tier)


def build(pair, prompt_ids: list[int], sampler, verifier, names: tuple[str, ...] | None,
          options: dict[str, dict[str, str]] | None = None, history=None) -> dict:
    """name → Proposer for a run: `names` (None: every one the pair has), canonical order.
    `history`: the cross-request SuffixHistory the suffix proposer reads (None: none), frozen
    by the caller for the run (Generation takes its snapshot)."""
    options = options or {}
    return {n: PROPOSERS[n](pair, prompt_ids, sampler, verifier, options.get(n, {}), history)
            for n in check_proposers(pair, names)}
