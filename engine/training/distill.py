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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

from engine.runtime import draft_model as draftlib
from engine.training.distill_config import DistillConfig
from engine.training.distill_data import Shard, build_data, heldout_prefix


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

