"""What `python -m engine distill` (engine/training/distill.py) is asked to do, a reason beside
each field; the data stage (distill_data.py) and the training stage read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.base.names import SHIPPED_DRAFT


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
        check_run(self, ("steps", "batch_tokens", "gen_batch", "top_k", "max_new_tokens", "ckpt_every",
                         "heldout_per_task"))
        if self.sharegpt_prompts < 0:
            raise ValueError(f"sharegpt_prompts must be ≥ 0, got {self.sharegpt_prompts}")


def check_run(cfg, counts: tuple[str, ...]) -> None:
    """What a distillation's config (the draft's, the EAGLE head's) must hold: each of `counts`
    at least 1, a known stage, a positive learning rate; ValueError in one line otherwise."""
    for name in counts:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be ≥ 1, got {getattr(cfg, name)}")
    if cfg.stage not in ("all", "data"):
        raise ValueError(f"stage must be all or data, got {cfg.stage!r}")
    if not cfg.lr > 0:
        raise ValueError(f"lr must be > 0, got {cfg.lr}")
