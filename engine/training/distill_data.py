"""Stage 1 of `python -m engine distill` (engine/training/distill.py): the target's own greedy
responses to the training prompts (and real requests, and plain text), with its top-k
log-probabilities at every response position, in shards written whole or not at all; held-out
prompts' shards are for evaluation only. With `ids`, the responses' token ids are read back from
one compact file and a teacher-forced pass rebuilds the top-k instead of generating again."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from engine.datasets import prompts as promptlib
from engine.lab.generation import encode_prompt
from engine.training.distill_config import DistillConfig


@dataclass
class Shard:
    """Sequences with teacher targets. For each sequence, the rows of `topk_*` (in order) hold
    the target's view of predicting its tokens label_start, label_start + 1, … from the prefix."""

    tokens: torch.Tensor  # [T] int32, sequences concatenated
    offsets: torch.Tensor  # [n + 1] int64
    label_start: torch.Tensor  # [n] int32: first token index (within its sequence) with a label
    topk_idx: torch.Tensor  # [R, k] int32
    topk_logp: torch.Tensor  # [R, k] float16

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in asdict(self).items()}, str(tmp))
        tmp.replace(path)  # a shard exists whole or not at all

    @classmethod
    def load(cls, path: Path) -> "Shard":
        return cls(**load_file(str(path)))

    def sequences(self) -> list[tuple[list[int], int, int]]:
        """(tokens, label_start, first teacher row) per sequence."""
        out, row = [], 0
        for i in range(len(self.offsets) - 1):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            start = int(self.label_start[i])
            out.append((self.tokens[a:b].tolist(), start, row))
            row += (b - a) - start
        assert row == len(self.topk_idx), (row, len(self.topk_idx))
        return out


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = logp.topk(k, dim=-1)
    return idx.to(torch.int32), vals.to(torch.float16)


@torch.inference_mode()
def respond(target, tokenizer, prompts: list[str], max_new: int, k: int, eos_ids: frozenset[int]) -> Shard:
    """Greedy responses to chat prompts in one left-padded batch, with top-k per response token."""
    enc = [encode_prompt(tokenizer, p, chat=True) for p in prompts]
    width = max(map(len, enc))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    ids = torch.full((len(enc), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(enc):  # left padding: every row's next token sits at the same column
        ids[r, width - len(e):] = torch.tensor(e)
        mask[r, width - len(e):] = 1
    out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
    steps = torch.stack(out.logits, dim=1)  # [B, steps, V]
    seqs, starts, idx_rows, logp_rows = [], [], [], []
    for r, e in enumerate(enc):
        resp = out.sequences[r, width:].tolist()
        n = next((i + 1 for i, t in enumerate(resp) if t in eos_ids), len(resp))
        idx, logp = _topk(steps[r, :n], k)
        seqs.append(e + resp[:n]), starts.append(len(e)), idx_rows.append(idx), logp_rows.append(logp)
    return _shard(seqs, starts, idx_rows, logp_rows)


@torch.inference_mode()
def teach(target, seqs: list[list[int]], starts: list[int], k: int) -> Shard:
    """Top-k of the target at every labelled position of whole sequences (tokens starts[i]
    onwards), one teacher-forced forward each: what `respond` records, without generating."""
    device = next(target.parameters()).device
    idx_rows, logp_rows = [], []
    for toks, start in zip(seqs, starts):
        assert 1 <= start < len(toks), (start, len(toks))
        logits = target(torch.tensor([toks], device=device)).logits[0, start - 1:-1]  # [S - start, V]
        idx, logp = _topk(logits, k)
        idx_rows.append(idx.cpu()), logp_rows.append(logp.cpu())
    return _shard(seqs, starts, idx_rows, logp_rows)


def teach_text(target, token_lists: list[list[int]], k: int) -> Shard:
    """Top-k of the target at every position of plain texts (labels from the second token)."""
    return teach(target, token_lists, [1] * len(token_lists), k)


def _shard(seqs, starts, idx_rows, logp_rows) -> Shard:
    lens = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    return Shard(
        tokens=torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        offsets=lens.cumsum(0),
        label_start=torch.tensor(starts, dtype=torch.int32),
        topk_idx=torch.cat(idx_rows), topk_logp=torch.cat(logp_rows),
    )


HELDOUT_FILE_PER_TASK = 10  # the held-out file's prompts a task; their shards keep the name heldout-*


def heldout_prefix(cfg: DistillConfig) -> str:
    return "heldout" if cfg.heldout_per_task == HELDOUT_FILE_PER_TASK else f"heldout{cfg.heldout_per_task}"


class ResponseIds:
    """The token ids of every response shard (prompt + greedy answer, where labels start), in one
    safetensors file: ~4 bytes a token, so a whole data stage's generations fit in a few MB. The
    shards' top-k is not kept: one teacher-forced pass (`teach`) rebuilds it from these ids."""

    KEYS = ("target", "teacher_tier", "max_new_tokens")  # what the stored answers depend on, beside the prompts

    def __init__(self, path: Path, shards: dict[str, tuple[list[list[int]], list[int]]], meta: dict) -> None:
        self.path, self.shards, self.meta = path, shards, meta

    @staticmethod
    def config_meta(cfg: DistillConfig) -> dict[str, str]:
        return {k: str(getattr(cfg, k)) for k in ResponseIds.KEYS}

    @classmethod
    def read(cls, path: Path, cfg: DistillConfig) -> "ResponseIds":
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta, tensors = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # a torn or foreign file: say which, never half-read it
            raise ValueError(f"{path} is not a distill ids file ({type(e).__name__}: {e})") from None
        want = cls.config_meta(cfg)
        if any(meta.get(k) != v for k, v in want.items()):
            got = {k: meta.get(k) for k in want}
            raise ValueError(f"{path} holds answers made with {got}, not {want}: pass another --ids")
        shards = {}
        for name in sorted({k.rsplit("/", 1)[0] for k in tensors}):
            toks, offsets = tensors[f"{name}/tokens"].tolist(), tensors[f"{name}/offsets"].tolist()
            seqs = [toks[a:b] for a, b in zip(offsets, offsets[1:])]
            shards[name] = (seqs, tensors[f"{name}/label_start"].tolist())
        return cls(path, shards, meta)

    def check(self, name: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """The stored sequences of shard `name`, if they answer exactly these encoded prompts."""
        seqs, starts = self.shards[name]
        if [s[:a] for s, a in zip(seqs, starts)] != prompts:
            raise ValueError(f"{self.path}: shard {name} answers other prompts than this configuration asks "
                             "(another --prompts-per-task, --sharegpt-prompts or seed?): pass another --ids")
        return seqs, starts

    @staticmethod
    def write(path: Path, data: Path, cfg: DistillConfig) -> int:
        """Every response shard under `data` (not the plain-text ones: they are the Python docs);
        returns how many tokens were written."""
        tensors = {}
        for shard_path in sorted(data.glob("*.safetensors")):
            if shard_path.name.startswith("text-"):
                continue
            shard = Shard.load(shard_path)
            name = shard_path.stem
            tensors.update({f"{name}/tokens": shard.tokens, f"{name}/offsets": shard.offsets,
                            f"{name}/label_start": shard.label_start})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=ResponseIds.config_meta(cfg))
        tmp.replace(path)
        return sum(int(v.numel()) for k, v in tensors.items() if k.endswith("/tokens"))


def build_data(cfg: DistillConfig, target, tokenizer, eos_ids, progress, say=print) -> Path:
    """Writes shards under work/data, round by round; shards already there are kept (resumable).
    Answers stored in cfg.ids are teacher-forced instead of generated; new ones are added to it."""
    data = Path(cfg.work) / "data"
    data.mkdir(parents=True, exist_ok=True)
    ids_path = Path(cfg.ids) if cfg.ids else None
    stored = ResponseIds.read(ids_path, cfg) if ids_path is not None and ids_path.exists() else None
    made: list[str] = []

    def answers(name: str, prompts: list[str]) -> list[tuple[Path, Callable[[], Shard]]]:
        jobs = []
        for i in range(0, len(prompts), cfg.gen_batch):
            chunk, shard = prompts[i: i + cfg.gen_batch], f"{name}-{i // cfg.gen_batch:04d}"
            if stored is not None and shard in stored.shards:
                seqs, starts = stored.check(shard, [encode_prompt(tokenizer, p, chat=True) for p in chunk])
                jobs.append((data / f"{shard}.safetensors", lambda s=seqs, a=starts: teach(target, s, a, cfg.top_k)))
            else:
                made.append(shard)
                jobs.append((data / f"{shard}.safetensors", lambda c=chunk: respond(
                    target, tokenizer, c, cfg.max_new_tokens, cfg.top_k, eos_ids)))
        return jobs

    jobs = answers(heldout_prefix(cfg), [p for _, p in promptlib.heldout(cfg.heldout_per_task)])
    texts = list(promptlib.stdlib_texts())[: cfg.text_docs]
    for i in range(0, len(texts), 50):
        chunk = [tokenizer(t)["input_ids"][:256] for t in texts[i: i + 50]]
        jobs.append((data / f"text-{i // 50:04d}.safetensors", lambda c=chunk: teach_text(target, c, cfg.top_k)))
    if cfg.sharegpt_prompts:  # real requests, similar lengths in a batch: less padding
        jobs += answers("real", sorted(promptlib.real_training(cfg.sharegpt_prompts), key=len))
    seen: frozenset[str] = frozenset()
    for r in range(cfg.data_rounds):
        own = None if r == 0 else promptlib.prose_paragraphs(_answers(data, "train-[0-9]", tokenizer))
        train = [p for _, p in promptlib.training_prompts(cfg.prompts_per_task, cfg.seed, r, own, seen)]
        seen |= set(train)
        name = "train" if r == 0 else f"train-r{r}"  # round 0 keeps the original shard names: old work dirs resume
        jobs += answers(name, sorted(train, key=len))  # similar lengths share a batch: still deterministic
        for path, make in progress([j for j in jobs if not j[0].exists()], desc=f"distill data, round {r}", unit="shard"):
            make().save(path)
        jobs = []
    if ids_path is not None and (stored is None or made):
        say(f"{ResponseIds.write(ids_path, data, cfg):,} answer tokens kept in {ids_path}")
    return data


def _answers(data: Path, prefix: str, tokenizer) -> list[str]:
    """The target's responses stored in the shards named prefix*, decoded."""
    out = []
    for path in sorted(data.glob(f"{prefix}*.safetensors")):
        for toks, start, _ in Shard.load(path).sequences():
            out.append(tokenizer.decode(toks[start:], skip_special_tokens=True))
    return out
