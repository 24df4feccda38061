"""`python -m engine distill --kind eagle`: train an EAGLE head (engine/runtime/eagle_head.py) for a target.

Stages (each resumable; a rerun skips what is done):
1. text: the target's own greedy responses to the project's training prompts (what it will be
   asked to draft), real conversations from ShareGPT V3 (as EAGLE trains), and the held-out
   prompts' responses for evaluation only.
2. features: one teacher-forced target forward per sequence; the final-norm hidden states (fp16)
   and the target's greedy token at every position, in safetensors shards.
3. train: the head learns, from (f_i, x_{i+1}), the target's next feature and its distribution
   over the head's vocabulary, in two unrolled steps: the second reads the first's guessed
   feature, as drafting does beyond the first token (EAGLE-3's "training-time test": its keys
   and values for the earlier rows are the real ones, as the head's cache holds them live).
4. the head directory with a card of how it was made and what it measured.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.base.names import SHIPPED_EAGLE
from engine.datasets import prompts as promptlib
from engine.lab.generation import encode_messages
from engine.runtime import draft_model as draftlib
from engine.runtime import eagle_head as eaglelib
from engine.runtime.vocab_head import rank_tokens
from engine.training.distill import Checkpoint, optimize
from engine.training.distill_config import check_run
from engine.training.distill_data import respond


@dataclass
class EagleDistillConfig:
    target: str | None = None  # HF id / local dir; None = the embedded model
    out: str = str(SHIPPED_EAGLE)  # the head directory written at the end
    work: str = "eagle-work"  # shards and checkpoints (large; not committed)
    prompts_per_task: int = 48  # training prompts per task answered by the target (generation is the slow part)
    max_new_tokens: int = 128  # response length
    gen_batch: int = 32  # batched greedy generation
    sharegpt: int = 600  # ShareGPT V3 conversations, teacher-forced (real text, no generation)
    seq_len: int = 256  # tokens kept per sequence: longer ones are cut
    draft_vocab: int = 4096  # rows of the head's LM head: the most frequent target tokens (FR-Spec)
    steps: int = 400  # optimizer steps
    batch_seqs: int = 4  # sequences per step
    lr: float = 5e-4
    warmup: int = 20
    min_lr_frac: float = 0.1
    weight_decay: float = 0.0
    reg_weight: float = 1.0  # smooth-L1 on the guessed feature, beside cross-entropy on the distribution
    second_weight: float = 0.7  # the unrolled step's loss (drafting's tokens 2..γ live on it)
    ckpt_every: int = 25
    eval_every: int = 100
    seed: int = 0
    threads: int | None = None
    stage: str = "all"  # "data": stop once the feature shards exist

    def validate(self) -> None:
        check_run(self, ("steps", "batch_seqs", "gen_batch", "seq_len", "draft_vocab", "max_new_tokens", "ckpt_every"))


# -- text ------------------------------------------------------------------------------------------
def sharegpt_sequences(tokenizer, n: int, seq_len: int, seed: int) -> list[list[int]]:
    """The first turns of `n` ShareGPT conversations through the chat template, cut at seq_len."""
    from engine.datasets.sharegpt import conversations

    convs = list(itertools.islice(conversations(min_turns=2), n * 3))
    random.Random(seed).shuffle(convs)
    out = []
    for msgs in convs[:n]:
        ids = encode_messages(tokenizer, msgs[:1])  # ends with the assistant's header
        ids += tokenizer(msgs[1]["content"], add_special_tokens=False)["input_ids"]
        if len(ids) > 16:
            out.append(ids[:seq_len])
    return out


def response_sequences(target, tokenizer, prompts: list[str], cfg: EagleDistillConfig, eos_ids) -> list[list[int]]:
    ps = sorted(prompts, key=len)  # similar lengths share a batch: less padding
    out = []
    for i in range(0, len(ps), cfg.gen_batch):
        shard = respond(target, tokenizer, ps[i: i + cfg.gen_batch], cfg.max_new_tokens, 1, eos_ids)
        out += [toks[: cfg.seq_len] for toks, _, _ in shard.sequences()]
    return out


# -- features --------------------------------------------------------------------------------------
@dataclass
class FeatureShard:
    tokens: torch.Tensor  # [T] int32, sequences concatenated
    offsets: torch.Tensor  # [n + 1] int64
    feats: torch.Tensor  # [T, H] fp16: the target's final-norm state at each position
    greedy: torch.Tensor  # [T] int32: the target's argmax after each position

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in asdict(self).items()}, str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "FeatureShard":
        return cls(**load_file(str(path)))

    def sequences(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        o = self.offsets.tolist()
        return [(self.tokens[a:b], self.feats[a:b], self.greedy[a:b]) for a, b in zip(o, o[1:])]


@torch.inference_mode()
def featurize(target, seqs: list[list[int]], batch: int = 8) -> FeatureShard:
    """Teacher-forced target forwards, right-padded batches (padding cannot reach real rows)."""
    feats, greedy = [], []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i: i + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(chunk):
            ids[r, : len(s)], mask[r, : len(s)] = torch.tensor(s), 1
        hidden = target.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, S, H]
        logits = target.get_output_embeddings()(hidden)  # [B, S, V]
        for r, s in enumerate(chunk):
            feats.append(hidden[r, : len(s)].half())
            greedy.append(logits[r, : len(s)].argmax(-1).int())
    lens = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    return FeatureShard(torch.tensor([t for s in seqs for t in s], dtype=torch.int32), lens.cumsum(0),
                        torch.cat(feats), torch.cat(greedy))


def build_features(cfg: EagleDistillConfig, target, tokenizer, eos_ids, progress, say) -> Path:
    data = Path(cfg.work) / "features"
    data.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[Path, object]] = []
    held = [p for _, p in promptlib.heldout()]
    jobs.append((data / "heldout-0000.safetensors", lambda: response_sequences(target, tokenizer, held, cfg, eos_ids)))
    train = [p for _, p in promptlib.training_prompts(cfg.prompts_per_task, cfg.seed)]
    for i in range(0, len(train), cfg.gen_batch * 2):
        chunk = train[i: i + cfg.gen_batch * 2]
        jobs.append((data / f"train-{i // (cfg.gen_batch * 2):04d}.safetensors",
                     lambda c=chunk: response_sequences(target, tokenizer, c, cfg, eos_ids)))
    share = sharegpt_sequences(tokenizer, cfg.sharegpt, cfg.seq_len, cfg.seed)
    for i in range(0, len(share), 100):
        jobs.append((data / f"sharegpt-{i // 100:04d}.safetensors", lambda c=share[i: i + 100]: c))
    for path, make in progress([j for j in jobs if not j[0].exists()], desc="eagle features", unit="shard"):
        featurize(target, make()).save(path)
    return data


def load_shards(data: Path, prefix: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [s for p in sorted(data.glob(f"{prefix}-*.safetensors")) for s in FeatureShard.load(p).sequences()]


def choose_vocab(seqs, size: int, eos_ids, vocab: int) -> tuple[torch.Tensor, float]:
    """The `size` tokens the target emits most often on the training text (its greedy tokens),
    EOS always among them; returns the map and the share of greedy tokens it covers."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _, _, g in seqs:
        counts += torch.bincount(g.long(), minlength=vocab)[:vocab].double()
    top = rank_tokens(counts, eos_ids)[: min(size, vocab)].sort().values
    return top, float(counts[top].sum() / max(counts.sum(), 1))


# -- training --------------------------------------------------------------------------------------
def _batch(seqs, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (tokens [B, S], feats [B, S, H] fp32, greedy [B, S], mask [B, S])."""
    width = max(len(seqs[i][0]) for i in idx)
    H = seqs[idx[0]][1].shape[1]
    x = torch.zeros(len(idx), width, dtype=torch.long)
    f = torch.zeros(len(idx), width, H)
    g = torch.zeros(len(idx), width, dtype=torch.long)
    m = torch.zeros(len(idx), width, dtype=torch.bool)
    for r, i in enumerate(idx):
        t, feats, greedy = seqs[i]
        n = len(t)
        x[r, :n], f[r, :n], g[r, :n], m[r, :n] = t.long(), feats.float(), greedy.long(), True
    return x, f, g, m


def _step2(head: eaglelib.EagleHead, f1: torch.Tensor, x: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The second drafted row: row r reads (f̂_r, x_{r+1}), f̂_r the first step's guess from row
    r − 1; its attention sees the real rows 0 … r − 1 (what the cache holds live) and itself."""
    s, B, S, _ = head.shape, *feats.shape
    real = head.fc(torch.cat([head.embedding[x[:, 1:]], feats[:, :-1]], -1))  # step 1's inputs, recomputed
    guess_in = torch.cat([feats[:, :1], f1[:, :-1]], 1)  # [B, S-1, H]: row r gets f̂ from row r-1
    h = head.fc(torch.cat([head.embedding[x[:, 1:]], guess_in], -1))
    pos = torch.arange(S - 1)

    def qkv(z):
        y = eaglelib._rms(z, head.attn_norm, s.eps)
        q = eaglelib._rope(head.q(y).view(B, S - 1, s.heads, s.head_dim).transpose(1, 2), pos, s.rope_theta)
        k = eaglelib._rope(head.k(y).view(B, S - 1, s.kv_heads, s.head_dim).transpose(1, 2), pos, s.rope_theta)
        v = head.v(y).view(B, S - 1, s.kv_heads, s.head_dim).transpose(1, 2)
        rep = s.heads // s.kv_heads
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    _, k1, v1 = qkv(real)
    q2, k2, v2 = qkv(h)
    scale = 1.0 / math.sqrt(s.head_dim)
    past = (q2 @ k1.transpose(-1, -2)) * scale  # [B, h, S-1, S-1]
    past = past.masked_fill(~torch.ones(S - 1, S - 1, dtype=torch.bool).tril(-1), float("-inf"))
    own = (q2 * k2).sum(-1, keepdim=True) * scale  # [B, h, S-1, 1]
    w = torch.softmax(torch.cat([past, own], -1), -1)
    a = w[..., :-1] @ v1 + w[..., -1:] * v2  # [B, h, S-1, d]
    return head.finish(h + head.o(a.transpose(1, 2).reshape(B, S - 1, -1)))


def step_loss(head: eaglelib.EagleHead, batch, cfg: EagleDistillConfig) -> tuple[torch.Tensor, dict]:
    """Cross-entropy on the target's greedy token (what acceptance rewards; a row whose token is
    outside the head's vocabulary has no label) plus smooth-L1 on the guessed feature."""
    x, feats, greedy, mask = batch  # row r of a step predicts f_{r+1} and the target's token after it
    f1 = head(feats[:, :-1], x[:, 1:])  # [B, S-1, H]
    target_f = feats[:, 1:]
    inv = torch.full((head.embedding.shape[0],), -1, dtype=torch.long)
    inv[head.vocab_map] = torch.arange(head.vocab_map.numel())
    label = inv[greedy[:, 1:]]  # [B, S-1]: the target's token as a row of the head's LM head
    out, stats = 0.0, {}
    steps = [("1", f1, mask[:, 1:])]
    if cfg.second_weight > 0:
        f2 = _step2(head, f1, x, feats)
        ok2 = mask[:, 1:].clone()
        ok2[:, 0] = False  # row 0 has no earlier guess to read
        steps.append(("2", f2, ok2))
    for name, fh, ok in steps:
        logits = head.logits(fh[ok])  # [N, Vd]
        has = label[ok] >= 0
        ce = F.cross_entropy(logits[has], label[ok][has])
        reg = F.smooth_l1_loss(fh[ok], target_f[ok])
        hit = (logits.argmax(-1) == label[ok]).float().mean()
        out = out + (1.0 if name == "1" else cfg.second_weight) * (ce + cfg.reg_weight * reg)
        stats.update({f"ce{name}": ce.item(), f"reg{name}": reg.item(), f"acc{name}": hit.item()})
    return out, stats


@torch.no_grad()
def evaluate(head, seqs, cfg: EagleDistillConfig, chunk: int = 8) -> dict:
    """Teacher-forced accuracy against the target's greedy token, first and second drafted row."""
    tot: dict[str, float] = {}
    n = 0
    for i in range(0, len(seqs), chunk):
        idx = list(range(i, min(i + chunk, len(seqs))))
        _, st = step_loss(head, _batch(seqs, idx), cfg)
        for k, v in st.items():
            tot[k] = tot.get(k, 0.0) + v * len(idx)
        n += len(idx)
    return {k: v / max(n, 1) for k, v in tot.items()}


def train(cfg: EagleDistillConfig, head, seqs, held, progress, say=print) -> dict:
    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    ckpt = Checkpoint(Path(cfg.work))
    step, log = 0, []
    if ckpt.exists():
        step, log, _ = ckpt.load(head, opt)
        say(f"resuming at step {step}/{cfg.steps}")
    rng = random.Random(cfg.seed)
    order = [rng.sample(range(len(seqs)), cfg.batch_seqs) for _ in range(cfg.steps)]  # fixed: a resume sees the same

    def held_out() -> tuple[str, object, str]:
        value = evaluate(head, held, cfg)
        return "heldout", value, f"step {{step}}: held-out acc1 {value['acc1']:.3f} acc2 {value.get('acc2', 0):.3f}"

    step = optimize(head, opt, cfg, ckpt, step, log, lambda s: step_loss(head, _batch(seqs, order[s]), cfg),
                    held_out if held else None, progress, "eagle train",
                    lambda rec: dict(acc1=f"{rec['acc1']:.3f}", acc2=f"{rec.get('acc2', 0):.3f}"), say)
    final = log[-1].get("heldout") if log else None
    return dict(steps=step, heldout=final if final is not None else (evaluate(head, held, cfg) if held else None))


def run(cfg: EagleDistillConfig, progress, say=print) -> Path:
    """All stages for `cfg.target`; returns the head directory."""
    from engine.runtime.models import EMBEDDED, EMBEDDED_LABEL, _source_path, eos_ids_of, load_model, load_tokenizer

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev = torch.device("cpu")  # the head is small; the shards are read on the CPU
    target = load_model(cfg.target, "fp32", dev)
    tokenizer = load_tokenizer(cfg.target)
    eos = eos_ids_of(tokenizer, target)
    data = build_features(cfg, target, tokenizer, eos, progress, say)
    if cfg.stage == "data":
        say(f"features ready in {data}")
        return data
    seqs = load_shards(data, "train") + load_shards(data, "sharegpt")
    held = load_shards(data, "heldout")
    if not seqs:
        raise ValueError(f"no training sequences under {data}")
    embedding = draftlib.target_embedding(_source_path(cfg.target), target).float()
    vmap, coverage = choose_vocab(seqs, cfg.draft_vocab, eos, embedding.shape[0])
    say(f"draft vocabulary: {len(vmap)} tokens cover {coverage:.1%} of the target's greedy tokens")
    head = eaglelib.build_head(target, embedding, vmap)
    n_target = sum(p.numel() for p in target.parameters())
    del target
    summary = train(cfg, head, seqs, held, progress, say)
    name = EMBEDDED_LABEL if cfg.target in (None, "", EMBEDDED) else cfg.target
    meta = dict(
        target=name, target_fingerprint=draftlib.fingerprint(embedding), config=asdict(cfg),
        steps=summary["steps"], vocab_coverage=coverage, heldout=summary["heldout"],
        train_sequences=len(seqs), train_positions=int(sum(len(s[0]) for s in seqs)),
        macs_per_row_vs_target_token=eaglelib.rough_cost(head.shape, n_target),
        made_by="python -m engine distill --kind eagle",
    )
    out = Path(cfg.out)
    eaglelib.save_head(head, out, meta)
    say(f"EAGLE head written to {out} (held-out {summary['heldout']})")
    return out
