"""Verification math, apart from whatever proposed the tokens: the sampling law, greedy
acceptance, and exact rejection sampling. Notation as in gpt-fast: `q` is the target's
distribution, `p` the draft's."""
from __future__ import annotations

import math

import torch

from engine.decode.tree import ROOT, DraftTree, greedy_path

_LN2 = math.log(2.0)
# ATen splits a reduction of more than 32,768 elements (its grain) among the intra-op threads,
# each adding up its share, so a sum over a vocabulary rounds as the thread count says. Summed a
# block under the grain at a time (one thread each, in order), then the blocks in order, a law's
# mass and entropy have the same bits on any count: the workbench's decode turns may then drop to
# one thread while the CPU is wanted elsewhere (engine/runtime/kernels/threads.py).
_BLOCK = 16_384


def law_sum(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] summed over V with the same bits on any intra-op thread count: [..., 1]."""
    if x.shape[-1] <= _BLOCK:
        return x.sum(-1, keepdim=True)
    rows = x.reshape(-1, x.shape[-1])  # [R, V]
    sums = [torch.stack([b.sum() for b in row.split(_BLOCK)]).sum() for row in rows]
    return torch.stack(sums).reshape(*x.shape[:-1], 1)


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution from logits [..., V]: temperature, then top-p (as HF's warpers)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    # A token stays while the mass before it is < top_p; the most likely one always stays.
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return probs / law_sum(probs)


def greedy_accept(draft: list[int], q_argmax: list[int]) -> tuple[int, int]:
    """Accepted count n and the target's token at the first mismatch (or the bonus token).

    q_argmax[i] is the target's choice after the context plus draft[:i]; len = len(draft) + 1."""
    n = 0
    while n < len(draft) and draft[n] == q_argmax[n]:
        n += 1
    return n, q_argmax[n]


def rejection_sample(draft: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    p: [k, V] draft distributions the tokens were sampled from; q: [k+1, V] target's.
    Token i is accepted with probability min(1, q_i(x)/p_i(x)); on the first rejection the
    replacement comes from norm(max(0, q_i − p_i)); if all k pass, a bonus token from q_k.
    The emitted tokens are then distributed exactly as the target's own samples."""
    k = len(draft)
    u = torch.rand(k, generator=gen, device=q.device)
    for i, x in enumerate(draft):
        if u[i] * p[i, x] <= q[i, x]:  # u < q/p without dividing by a tiny p
            continue
        residual = (q[i] - p[i]).clamp_min(0.0)
        total = law_sum(residual)[0]
        # q == p up to rounding leaves no residual mass; then q itself is the right law.
        dist = residual / total if total > 0 else q[i]
        return i, int(torch.multinomial(dist, 1, generator=gen))
    return k, int(torch.multinomial(q[k], 1, generator=gen))


def tree_sample(tree: DraftTree, q: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Multi-draft speculative sampling down a token tree (SpecInfer's recursive rejection sampling,
    without replacement as in Sequoia). q: [N+1, V], the target's law after each row's path.

    At row r the children c_1 … c_m are tried in the order they were added. Child i was drawn from
    its law p_i restricted to the tokens its earlier siblings do not hold (its DraftToken.p, None
    for a proposal made without a law: the one-hot of its token). It is accepted with probability
    min(1, q_r(x)/p_i(x)); on rejection q_r ← norm(max(0, q_r − p_i)) and the next child is tried
    against that residual. Each try is one speculative-sampling round whose target is what the
    earlier rejections left, so the token that leaves row r (an accepted child, else a draw from
    the last residual) follows q_r; an accepted child becomes the row and the walk goes on below.
    Returns (accepted rows; the token after the last of them)."""
    row, path = ROOT, []
    while True:
        law = q[row]
        tried: list[int] = []
        nxt = None
        for c in tree.children(row):
            x = tree.tokens[c - 1]
            p_c = _restricted(tree.drafts[c - 1].p, x, tried, law)
            if float(torch.rand((), generator=gen, device=law.device)) * p_c[x] <= law[x]:  # u < q/p, no division
                nxt = c
                break
            residual = (law - p_c).clamp_min(0.0)
            total = law_sum(residual)[0]
            law = residual / total if total > 0 else law  # q == p up to rounding: q itself
            tried.append(x)
        if nxt is None:
            return path, int(torch.multinomial(law, 1, generator=gen))
        path.append(nxt)
        row = nxt


def _restricted(p: torch.Tensor | None, x: int, tried: list[int], like: torch.Tensor) -> torch.Tensor:
    """The law child token x was drawn from: p without the earlier siblings' tokens, renormalized
    (sampling without replacement); the one-hot of x where no law was given."""
    if p is None:
        return torch.zeros_like(like).index_fill_(0, torch.tensor([x], device=like.device), 1.0)
    if not tried:
        return p
    p = p.clone()
    p[tried] = 0.0
    return p / law_sum(p)[0]


class Sampler:
    """How tokens are chosen from logits, shared by a run's proposer and verifier (one seeded
    generator: a seed reproduces the run). temperature 0 is greedy."""

    def __init__(self, temperature: float, top_p: float, seed: int | None, device: torch.device) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.gen = torch.Generator(device=device)
        if seed is not None:
            self.gen.manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def law(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from: [..., V] → [..., V]."""
        return torch.softmax(logits, dim=-1) if self.greedy else warp(logits, self.temperature, self.top_p)

    def choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A token from logits [V] and the law behind it. Greedy takes the logits' argmax, as HF's
        greedy search does (the softmax is kept for the draft's signals)."""
        p = self.law(logits)
        if self.greedy:
            return int(logits.argmax()), p
        return int(torch.multinomial(p, 1, generator=self.gen)), p

    def accept(self, draft: list[int], p: torch.Tensor | None, logits: torch.Tensor) -> tuple[int, int]:
        """(accepted n, the token after them) for draft tokens drawn from p [k, V], given the
        target's logits [k+1, V] over the context and each draft prefix."""
        if self.greedy:
            return greedy_accept(draft, logits.argmax(-1).tolist())
        q = warp(logits, self.temperature, self.top_p)  # [k+1, V]
        return rejection_sample(draft, p if p is not None else q[:0], q, self.gen)

    def accept_tree(self, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
        """(accepted rows, the token after them) for a token tree, given the target's logits
        [N+1, V] after each row's path (row 0: the root, the newest emitted token)."""
        if self.greedy:
            return greedy_path(tree, logits.argmax(-1).tolist())
        return tree_sample(tree, warp(logits, self.temperature, self.top_p), self.gen)


def draft_signals(p: torch.Tensor) -> tuple[float, float]:
    """(entropy in bits, confidence = max probability) of one drafted position's law [V]."""
    # xlogy gives 0·log 0 = 0, so truncated (top-p) distributions need no epsilon.
    entropy = -law_sum(torch.special.xlogy(p, p))[..., 0] / _LN2
    return float(entropy), float(p.max())
