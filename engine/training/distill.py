"""`python -m engine distill`: make a draft for a target by distillation.

Stages (each resumable; a rerun skips what is done):
1. data: the target's own greedy responses to the project's training prompts (batched
   generation) and, with --sharegpt-prompts, to real requests (ShareGPT's opening turns), with
   the target's top-k log-probabilities at every response position, plus plain text on every
   machine (the Python docs) with the target's top-k over it. Held-out prompts get responses
   too, for evaluation only. With --ids, the responses' token ids are kept in one compact file
   (a few MB: it can be committed) and read back on the next machine, where one teacher-forced
   pass per sequence rebuilds the top-k instead of generating again.
2. train: a few layers initialised from chosen target layers learn, with the target's embedding
   and head frozen, to match the target: cross-entropy on its greedy token (what acceptance
   rewards) plus KL on its top-k. AdamW, warm-up + cosine, checkpoints as safetensors + JSON.
3. the draft directory (engine/runtime/draft_model.py) with a card of how it was made and what it
   measured, held-out agreement against CPU-minutes of training (`curve`) included.
"""
from __future__ import annotations

import itertools
import json
import math
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

from engine.base.names import SHIPPED_DRAFT
from engine.datasets import prompts as promptlib
from engine.lab.generation import encode_prompt
from engine.runtime import draft_model as draftlib


@dataclass
class DistillConfig:
    target: str | None = None  # HF id / local dir; None = the embedded model
    out: str = str(SHIPPED_DRAFT)  # the draft directory written at the end
    work: str = "distill-work"  # data shards and checkpoints (large; not committed)
    layers: list[int] = field(default_factory=lambda: [0, 1, 2, 29])  # target layers to copy
    init_from: str | None = None  # start from an existing SpecLab draft (continue its training)
    prompts_per_task: int = 400  # training prompts per task (fewer exist for chat)
    data_rounds: int = 1  # round r >= 1 adds prompts_per_task new prompts per task with wider everyday
    #                       forms, summarizing the target's own round-0 answers (general prose)
    teacher_tier: str = "bf16"  # the target's tier for making data: far faster than fp32 batched on CPU,
    #                             same greedy tokens but at rare near-ties (agreement is measured at fp32)
    max_new_tokens: int = 160  # response length; drafts are used on responses
    gen_batch: int = 32  # batched generation is far faster per token than one at a time
    top_k: int = 32  # teacher log-probs kept per position for the KL term
    text_docs: int = 300  # Python-docs paragraphs added as plain text (off-policy seasoning)
    sharegpt_prompts: int = 0  # real requests (ShareGPT opening turns, prompts.real_training) answered by the
    #                            target beside the templates; real held-out prompts are never among them
    heldout_per_task: int = 10  # agreement is measured on these: the held-out file's 10 a task, then real
    #                             prompts nothing trains on (prompts.heldout)
    ids: str | None = None  # compact token ids of every response (prompt + greedy answer): read where the
    #                         file exists (a teacher-forced pass instead of generation), written where not
    steps: int = 3000  # optimizer steps
    batch_tokens: int = 4096  # loss positions per step (a step packs whole sequences)
    lr: float = 1e-3
    warmup: int = 100
    min_lr_frac: float = 0.1  # cosine decays to this fraction of lr
    weight_decay: float = 0.0  # the layers start from the target's: no pull towards zero
    ce_weight: float = 1.0  # cross-entropy on the target's greedy token
    kl_weight: float = 1.0  # KL(target top-k ‖ draft)
    ckpt_every: int = 50  # steps between checkpoints
    eval_every: int = 250  # steps between held-out agreement checks
    autocast_bf16: bool = True  # bf16 matmuls in training: much faster on AVX512-BF16 CPUs and GPUs
    seed: int = 0
    threads: int | None = None
    stage: str = "all"  # "data": stop once the shards exist (to inspect or share them)

    def validate(self) -> None:
        if not self.layers:
            raise ValueError("--layers needs at least one target layer index")
        for name in ("steps", "batch_tokens", "gen_batch", "top_k", "max_new_tokens", "ckpt_every",
                     "heldout_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.stage not in ("all", "data"):
            raise ValueError(f"stage must be all or data, got {self.stage!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.sharegpt_prompts < 0:
            raise ValueError(f"sharegpt_prompts must be ≥ 0, got {self.sharegpt_prompts}")


# -- data ----------------------------------------------------------------------------------------
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


# -- training ------------------------------------------------------------------------------------
@dataclass
class Example:
    tokens: list[int]
    label_start: int
    topk_idx: torch.Tensor  # [len - label_start, k]
    topk_logp: torch.Tensor

    @property
    def n_labels(self) -> int:
        return len(self.tokens) - self.label_start


def load_examples(data: Path, prefix: str) -> list[Example]:
    out = []
    for path in sorted(data.glob(f"{prefix}-*.safetensors")):
        shard = Shard.load(path)
        for toks, start, row in shard.sequences():
            n = len(toks) - start
            out.append(Example(toks, start, shard.topk_idx[row: row + n], shard.topk_logp[row: row + n]))
    return out


def batches(examples: list[Example], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Index lists whose label counts add up to about batch_tokens; the order depends only on
    (seed, epoch), so a resumed run sees exactly the batches it would have seen."""
    order = list(range(len(examples)))
    random.Random(seed * 100003 + epoch).shuffle(order)
    out, cur, n = [], [], 0
    for i in order:
        cur.append(i)
        n += examples[i].n_labels
        if n >= batch_tokens:
            out.append(cur)
            cur, n = [], 0
    return out


def _schedule(examples: list[Example], cfg: DistillConfig) -> Iterator[list[int]]:
    """Batches epoch after epoch (epochs may differ in batch count: packing follows the order)."""
    for epoch in itertools.count():
        yield from batches(examples, cfg.batch_tokens, cfg.seed, epoch)


def step_loss(draft, batch: list[Example], cfg: DistillConfig) -> tuple[torch.Tensor, dict]:
    width = max(len(e.tokens) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(batch):
        ids[r, : len(e.tokens)] = torch.tensor(e.tokens)
        mask[r, : len(e.tokens)] = 1
    device = next(draft.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        hidden = draft.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        # hidden: [B, S, H]. Position p predicts token p + 1: keep the positions with a label.
        rows = torch.cat([torch.full((e.n_labels,), r) for r, e in enumerate(batch)])
        cols = torch.cat([torch.arange(e.label_start - 1, len(e.tokens) - 1) for e in batch])
        logits = draft.get_output_embeddings()(hidden[rows, cols])  # [N, V]
    logp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.cat([e.topk_idx for e in batch]).long().to(device)  # [N, k]
    t_logp = torch.cat([e.topk_logp for e in batch]).float().to(device)
    ce = -logp.gather(1, idx[:, :1]).mean()  # the target's greedy token
    t_p = t_logp.exp()
    kl = (t_p * (t_logp - logp.gather(1, idx))).sum(1).mean()  # KL over the teacher's top-k
    agree = (logits.argmax(-1) == idx[:, 0]).float().mean()
    stats = dict(ce=ce.item(), kl=kl.item(), agree=agree.item())
    return cfg.ce_weight * ce + cfg.kl_weight * kl, stats


@torch.inference_mode()
def agreement(draft, examples: list[Example], chunk: int = 16) -> float:
    """Teacher-forced greedy agreement: how often the draft's argmax is the target's."""
    hits = total = 0.0
    for i in range(0, len(examples), chunk):
        sel = examples[i: i + chunk]
        _, stats = step_loss(draft, sel, DistillConfig())
        n = sum(e.n_labels for e in sel)
        hits, total = hits + stats["agree"] * n, total + n
    return hits / max(total, 1)


def lr_at(step: int, cfg: DistillConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class Checkpoint:
    """Draft weights + AdamW moments in safetensors, the rest in JSON: no pickle anywhere."""

    def __init__(self, work: Path) -> None:
        self.tensors, self.meta = work / "ckpt.safetensors", work / "ckpt.json"

    def exists(self) -> bool:
        return self.tensors.exists() and self.meta.exists()

    def save(self, draft, opt: torch.optim.AdamW, step: int, log: list[dict], cfg: DistillConfig) -> None:
        names = {id(p): n for n, p in draft.named_parameters() if p.requires_grad}
        tensors = {f"w/{n}": p.detach() for n, p in draft.named_parameters() if p.requires_grad}
        for p, s in opt.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"{key}/{names[id(p)]}"] = s[key]
            tensors[f"step/{names[id(p)]}"] = s["step"].reshape(1).float()
        tmp_t, tmp_m = (p.with_name(p.name + ".tmp") for p in (self.tensors, self.meta))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_t))
        tmp_m.write_text(json.dumps(dict(step=step, log=log, config=asdict(cfg))))
        tmp_t.replace(self.tensors)
        tmp_m.replace(self.meta)

    def load(self, draft, opt: torch.optim.AdamW) -> tuple[int, list[dict], dict]:
        tensors = load_file(str(self.tensors))
        meta = json.loads(self.meta.read_text())
        params = dict(draft.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                if p.requires_grad:
                    p.copy_(tensors[f"w/{n}"])
        for n, p in params.items():
            if p.requires_grad and f"exp_avg/{n}" in tensors:
                opt.state[p] = dict(exp_avg=tensors[f"exp_avg/{n}"], exp_avg_sq=tensors[f"exp_avg_sq/{n}"],
                                    step=tensors[f"step/{n}"].reshape(()))
        return meta["step"], meta["log"], meta["config"]


def optimize(model, opt: torch.optim.Optimizer, cfg, ckpt: "Checkpoint", step: int, log: list[dict],
             loss_at: Callable[[int], tuple[torch.Tensor, dict]],
             evaluate: Callable[[], tuple[str, object, str]] | None, progress, desc: str,
             postfix: Callable[[dict], dict], say=print) -> int:
    """The optimizer loop every distillation shares, from `step` to cfg.steps: warm-up + cosine
    learning rate (`lr_at`), clipped steps, `evaluate()` → (log key, value, message) every
    cfg.eval_every steps and at the end, a checkpoint every cfg.ckpt_every. Ctrl-C finishes the
    step, saves and raises KeyboardInterrupt. Returns the last step."""
    params = [p for p in model.parameters() if p.requires_grad]
    # CPU seconds of training so far (every thread; evaluations left out), carried over a resume
    cpu_base, cpu_start, eval_cpu = (log[-1].get("cpu_s", 0.0) if log else 0.0), time.process_time(), 0.0
    stop = {"now": False}
    previous = signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))  # finish the step, then save
    model.train()
    try:
        bar = progress(total=cfg.steps, initial=step, desc=desc, unit="step")
        while step < cfg.steps and not stop["now"]:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            loss, stats = loss_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            log.append(dict(step=step, loss=loss.item(), **stats, t=time.time(),
                            cpu_s=cpu_base + time.process_time() - cpu_start - eval_cpu))
            bar.update(1)
            bar.set_postfix(**postfix(log[-1]))
            if evaluate is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
                model.eval()
                t0 = time.process_time()
                key, value, message = evaluate()
                eval_cpu += time.process_time() - t0
                log[-1][key] = value
                model.train()
                say(message.format(step=step))
            if step % cfg.ckpt_every == 0 or step == cfg.steps or stop["now"]:
                ckpt.save(model, opt, step, log, cfg)
        bar.close()
    finally:
        signal.signal(signal.SIGINT, previous)
        model.eval()
    if stop["now"]:
        ckpt.save(model, opt, step, log, cfg)
        raise KeyboardInterrupt(f"stopped at step {step}; checkpoint kept in {cfg.work}")
    return step


def train(cfg: DistillConfig, draft, data: Path, progress, say=print) -> dict:
    """Trains `draft` in place; resumes from work/ckpt.*; Ctrl-C saves and stops cleanly."""
    torch.manual_seed(cfg.seed)
    examples = load_examples(data, "train") + load_examples(data, "real") + load_examples(data, "text")
    held = load_examples(data, heldout_prefix(cfg))
    if not batches(examples, cfg.batch_tokens, cfg.seed, 0):
        raise ValueError(f"the training data under {data} holds fewer labels than one batch ({cfg.batch_tokens})")
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    ckpt = Checkpoint(Path(cfg.work))
    step, log = 0, []
    if ckpt.exists():
        step, log, old = ckpt.load(draft, opt)
        if old.get("layers") != cfg.layers:
            raise ValueError(f"checkpoint in {cfg.work} is for layers {old.get('layers')}, not {cfg.layers}")
        say(f"resuming at step {step}/{cfg.steps}")
    schedule = itertools.islice(_schedule(examples, cfg), step, None)  # a resumed run skips what it did

    def held_out() -> tuple[str, object, str]:
        value = agreement(draft, held)
        return "heldout_agreement", value, f"step {{step}}: held-out agreement {value:.3f}"

    if step == 0 and held:  # the curve's first point: the draft as training finds it
        log.append(dict(step=0, cpu_s=0.0, heldout_agreement=agreement(draft, held)))

    step = optimize(draft, opt, cfg, ckpt, step, log, lambda s: step_loss(draft, [examples[j] for j in next(schedule)], cfg),
                    held_out if held else None, progress, "distill train",
                    lambda rec: dict(loss=f"{rec['loss']:.3f}", agree=f"{rec['agree']:.3f}"), say)
    final = log[-1].get("heldout_agreement") if log else None  # measured at the last step
    if final is None and held:
        final = agreement(draft, held)
    return dict(steps=step, log=log, heldout_agreement=final, curve=curve(log),
                train_sequences=len(examples), train_labels=sum(e.n_labels for e in examples))


def curve(log: list[dict]) -> list[dict]:
    """Held-out agreement against CPU-minutes of training (the process's CPU time over all its
    threads, evaluations excluded, summed over resumed runs): one point per evaluation."""
    return [dict(step=r["step"], cpu_min=round(r["cpu_s"] / 60, 2), heldout_agreement=round(r["heldout_agreement"], 4))
            for r in log if "heldout_agreement" in r and "cpu_s" in r]


def format_curve(points: list[dict]) -> str:
    return "held-out agreement by CPU-minutes of training: " + ", ".join(
        f"{p['cpu_min']:g} min {p['heldout_agreement']:.3f}" for p in points)


def run(cfg: DistillConfig, progress, say=print) -> Path:
    """All stages for `cfg.target`; returns the draft directory."""
    from engine.runtime.models import EMBEDDED, EMBEDDED_LABEL, eos_ids_of, load_model, load_tokenizer

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda")
    target = load_model(cfg.target, cfg.teacher_tier, dev)
    tokenizer = load_tokenizer(cfg.target)
    data = build_data(cfg, target, tokenizer, eos_ids_of(tokenizer, target), progress, say)
    if cfg.stage == "data":
        say(f"data ready in {data}")
        return data
    if cfg.teacher_tier != "fp32":  # the draft is built, trained and stored from fp32 weights
        del target
        target = load_model(cfg.target, "fp32", dev)
    if cfg.init_from:  # continue a shipped draft: its weights, fresh optimizer state
        meta = json.loads((Path(cfg.init_from) / draftlib.MARKER).read_text())
        cfg.layers = meta["init_layers"]
        draft = draftlib.load_draft(cfg.init_from, target.get_input_embeddings().weight, dev).train()
    else:
        draft = draftlib.build_draft(target, cfg.layers)
    del target  # training needs only the draft: the teacher's views are in the shards
    summary = train(cfg, draft, data, progress, say)
    name = EMBEDDED_LABEL if cfg.target in (None, "", EMBEDDED) else cfg.target
    meta = dict(
        target=name, target_fingerprint=draftlib.fingerprint(draft.get_input_embeddings().weight),
        init_layers=cfg.layers, config=asdict(cfg), steps=summary["steps"],
        continued_from=cfg.init_from,
        train_sequences=summary["train_sequences"], train_labels=summary["train_labels"],
        heldout_agreement=summary["heldout_agreement"], curve=summary["curve"],
        made_by="python -m engine distill",
    )
    out = Path(cfg.out)
    draftlib.save_draft(draft, out, meta)
    say(format_curve(summary["curve"]))
    say(f"draft written to {out} (held-out agreement {summary['heldout_agreement']})")
    return out

