"""Tiny randomly initialised Llama models with a character-level tokenizer, for tests that need
a model but not its quality. Built from a config in a second; nothing is downloaded."""
from __future__ import annotations

import functools
import json
import string
from pathlib import Path

import torch

CHARS = string.ascii_letters + string.digits + " .,:;!?'\"()-+*/=_\n"
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tokenizer(out: Path, extra_tokens: int = 0) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS) + [f"<x{i}>" for i in range(extra_tokens)])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(vocab)


def save_tiny_llama(out: Path, seed: int, layers: int = 2, hidden: int = 32, extra_tokens: int = 0,
                    base: Path | None = None, noise: float = 0.0) -> Path:
    """A random Llama at `out`. With `base`, a copy of that model's weights plus Gaussian noise of
    scale `noise`: a draft that agrees with its target often, but not always."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(out, extra_tokens)
    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p) * p.std())
    else:
        cfg = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            tie_word_embeddings=True, initializer_range=0.2,
        )
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    (out / "speclab-test.json").write_text(json.dumps({"seed": seed, "noise": noise}))
    return out


@functools.lru_cache(maxsize=None)
def synthetic_context(draft_ms: float = 1.0, verify0: float = 10.0, per_token: float = 0.5):
    """A PolicyContext for `speckv`/`rakv` without measuring or storing anything: verify over
    k + 1 tokens costs verify0 + k·per_token ms, and the MLP is fitted on made-up steps where
    confident drafts are accepted and longer ones less. Made once per argument set: the
    context is read-only, and fitting the MLP per generation would dominate the tests."""
    import numpy as np

    from engine.decode.costs import CostTable
    from engine.decode.policies import PolicyContext
    from engine.decode.records import K_MAX
    from engine.training.retrain import fit_mlp

    rng = np.random.default_rng(0)
    x = np.column_stack([rng.uniform(0, 4, 400), rng.uniform(0.2, 1, 400), rng.uniform(0, 6, 400),
                         rng.uniform(0, 1, 400), rng.integers(0, 3, 400), rng.choice([1, 2, 4, 6, 8], 400)])
    mlp = fit_mlp(x, np.clip(x[:, 1] - 0.05 * x[:, 5], 0, 1))
    costs = CostTable([1], [draft_ms], [[verify0 + k * per_token for k in range(K_MAX + 1)]])
    return PolicyContext(costs=costs, controller=lambda name, version: mlp)
