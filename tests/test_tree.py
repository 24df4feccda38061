"""Token trees (engine/decode/tree.py) and their acceptance (engine/oracles/sampling.py): the shape a
verify reads, greedy acceptance as plain greedy decoding would emit, and multi-draft speculative
sampling whose emitted tokens follow the target's law (χ², per tree shape and proposal kind)."""
from __future__ import annotations

import pytest
import torch
from test_speculative import _chi2_pvalue

from engine.decode.records import DraftToken
from engine.decode.tree import ROOT, DraftTree, budget_tree_shape, greedy_path
from engine.oracles.sampling import Sampler, greedy_accept, tree_sample


def _tok(t: int, p: torch.Tensor | None = None) -> DraftToken:
    return DraftToken(t, 0.0, 1.0, p)


def _bushy() -> DraftTree:
    """root ─┬─ 5 ─┬─ 7 ── 9
             │     └─ 8
             └─ 6 ── 7"""
    tree = DraftTree()
    a = tree.add(ROOT, _tok(5), "draft")
    b = tree.add(ROOT, _tok(6), "suffix")
    c = tree.add(a, _tok(7), "draft")
    tree.add(a, _tok(8), "draft")
    tree.add(b, _tok(7), "suffix")
    tree.add(c, _tok(9), "draft")
    return tree


def test_a_chain_is_the_tree_whose_nodes_each_follow_the_last():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 6, (), generator=gen))
        draft = torch.randint(0, 3, (k,), generator=gen).tolist()
        argmax = torch.randint(0, 3, (k + 1,), generator=gen).tolist()
        tree = DraftTree.chain([_tok(t) for t in draft])
        assert tree.is_chain() and tree.size == k and tree.positions(10) == list(range(10, 11 + k))
        assert tree.mask() == [[c <= r for c in range(k + 1)] for r in range(k + 1)]  # causal
        path, bonus = greedy_path(tree, argmax)
        assert (len(path), bonus) == greedy_accept(draft, argmax) and path == list(range(1, len(path) + 1))


def test_a_bushy_tree_reads_each_node_after_its_ancestors_only():
    tree = _bushy()
    assert tree.size == 6 and tree.max_depth == 3 and not tree.is_chain()
    assert tree.children(ROOT) == [1, 2] and tree.children(1) == [3, 4] and tree.path(6) == [1, 3, 6]
    assert tree.positions(40) == [40, 41, 41, 42, 42, 42, 43]
    m = tree.mask()
    assert [c for c in range(7) if m[6][c]] == [0, 1, 3, 6]  # root, 5, 7, 9
    assert [c for c in range(7) if m[5][c]] == [0, 2, 5]  # root, 6, 7: never the other branch
    assert not any(m[r][c] for r in range(7) for c in range(r + 1, 7))  # nothing after itself


def test_greedy_acceptance_walks_the_branch_the_target_chooses():
    tree = _bushy()
    #            row: 0  1  2  3  4  5  6
    assert greedy_path(tree, [5, 7, 1, 9, 2, 3, 4]) == ([1, 3, 6], 4)  # 5 7 9, then the target's 4
    assert greedy_path(tree, [6, 0, 7, 0, 0, 2, 0]) == ([2, 5], 2)  # the second child, then its 7
    assert greedy_path(tree, [5, 8, 0, 0, 3, 0, 0]) == ([1, 4], 3)  # the second grandchild
    assert greedy_path(tree, [4, 0, 0, 0, 0, 0, 0]) == ([], 4)  # no child: a plain step's token
    logits = torch.full((7, 12), -5.0)
    logits[torch.arange(7), torch.tensor([5, 7, 1, 9, 2, 3, 4])] = 5.0
    assert Sampler(0.0, 1.0, 0, torch.device("cpu")).accept_tree(tree, logits) == ([1, 3, 6], 4)


def test_a_tree_a_verify_cannot_read_is_refused_in_one_line():
    tree = _bushy()
    assert tree.check(context_left=4, vocab=12) is tree
    with pytest.raises(ValueError, match=r"^a tree 3 deep needs 4 positions; the context leaves 3$"):
        tree.check(context_left=3, vocab=12)
    with pytest.raises(ValueError, match=r"^token 9 in the tree is outside the vocabulary \(0…8\)$"):
        tree.check(context_left=10, vocab=9)
    tree.add(ROOT, _tok(5), "ngram")
    with pytest.raises(ValueError, match="same token twice among its children"):
        tree.check(context_left=10, vocab=12)
    with pytest.raises(ValueError, match=r"^a tree's node budget must be at least 1, got 0$"):
        budget_tree_shape(0, 2, 100)
    with pytest.raises(ValueError, match=r"^a tree's width must be from 1 to the vocabulary \(100\), got 101$"):
        budget_tree_shape(8, 101, 100)


# -- the sampling law ---------------------------------------------------------------------------------
V = 6


def _laws(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, draft): each a law over V tokens per previous token, [V, V], deliberately unlike."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    p = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return q, p


def _without(p: torch.Tensor, taken: list[int], gen: torch.Generator) -> int:
    p = p.clone()
    p[taken] = 0.0
    return int(torch.multinomial(p / p.sum(), 1, generator=gen))


def _grow(last: int, p: torch.Tensor, widths: tuple[int, ...], fixed: dict[int, int], gen) -> DraftTree:
    """A tree `widths` wide per level, children drawn from the draft without replacement; where
    `fixed` names a level, its first child is that token with no law (a lookup's proposal)."""
    tree, level, prev = DraftTree(), [(ROOT, last)], {ROOT: last}
    for depth, width in enumerate(widths):
        nxt = []
        for row, tok in level:
            taken: list[int] = []
            for j in range(width):
                if j == 0 and depth in fixed:
                    t, law = fixed[depth], None
                else:
                    t, law = _without(p[tok], taken, gen), p[tok]
                taken.append(t)
                child = tree.add(row, _tok(t, law), "ngram" if law is None else "draft")
                prev[child] = t
                nxt.append((child, t))
        level = nxt
    return tree


@pytest.mark.parametrize("widths,fixed", [((3,), {}), ((2, 2), {}), ((1, 3), {}), ((2, 2), {0: 4, 1: 1})],
                         ids=["one level of 3", "2 × 2", "chain then 3", "mixed: a lookup's child first"])
def test_tree_sampling_emits_the_target_law(widths, fixed):
    """The first two emitted tokens of each trial, against q(x1)·q(x2 | x1), by χ²: whatever the
    tree's shape and whether a child came with a law or from a lookup."""
    q, p = _laws(3)
    gen = torch.Generator().manual_seed(11)
    last, pairs, N = 2, [], 12000
    for _ in range(N):
        tree = _grow(last, p, widths, fixed, gen)
        rows = [last] + tree.tokens  # the token each row ends with
        path, bonus = tree_sample(tree, q[torch.tensor(rows)], gen)
        out = [tree.tokens[r - 1] for r in path] + [bonus]
        if len(out) == 1:  # nothing accepted: the second token is the target's own next draw
            out.append(int(torch.multinomial(q[out[0]], 1, generator=gen)))
        pairs.append(out[0] * V + out[1])
    joint = (q[last][:, None] * q).reshape(-1)  # [V·V]
    assert _chi2_pvalue(pairs, joint) > 1e-3


@pytest.mark.parametrize("nodes,width", [(4, 2), (6, 3)])
def test_trees_grown_as_runs_grow_them_emit_the_target_law(nodes, width):
    """The proposer's growth (oracles/tree_growth.grow: children drawn without replacement, the
    best nodes kept by path probability, siblings in draw order) then multi-draft sampling: the
    first two emitted tokens follow q(x1)·q(x2 | x1), by χ²."""
    from engine.oracles.tree_growth import grow

    q, p = _laws(5)
    sampler = Sampler(1.0, 1.0, 13, torch.device("cpu"))
    last, pairs, N = 1, [], 6000

    def read(tree, rows):  # the draft's law after each row's last token
        return torch.stack([p[tree.tokens[r - 1] if r != ROOT else last] for r in rows])

    for _ in range(N):
        tree = grow(read, nodes, width, sampler, "draft")
        rows = [last] + tree.tokens
        path, bonus = tree_sample(tree, q[torch.tensor(rows)], sampler.gen)
        out = [tree.tokens[r - 1] for r in path] + [bonus]
        if len(out) == 1:
            out.append(int(torch.multinomial(q[out[0]], 1, generator=sampler.gen)))
        pairs.append(out[0] * V + out[1])
    assert _chi2_pvalue(pairs, (q[last][:, None] * q).reshape(-1)) > 1e-3


# -- one target read of a tree (engine/oracles/target.py verify_tree) ------------------------------------
def _verifier(pair, prompt: list[int], kv_tier: str = "native"):
    from engine.oracles.target import TargetVerifier

    v = TargetVerifier(pair, prompt, Sampler(0.0, 1.0, None, pair.device), kv_tier=kv_tier)
    with torch.inference_mode():  # as every run reads: gradients on take torch's own path
        v.prefill()
    return v


def test_a_tree_read_scores_each_row_as_a_read_of_its_path_would(tiny_pair):
    """Every row's logits from one tree read against the same row read as a chain of its own path;
    after acceptance the cache holds the root and the accepted path only, as a chain's would."""
    from engine.runtime.forward import forward_logits, forward_tree_logits

    prompt = list(range(3, 40))
    v = _verifier(tiny_pair, prompt)
    tree = _bushy()
    start = len(v.tokens) - 1
    with torch.inference_mode():
        logits, cache = forward_tree_logits(tiny_pair.target, [v.tokens[-1]] + tree.tokens, v.cache, tree.mask(),
                                            tree.positions(start), tiny_pair.vocab_size)  # [7, V]
        for row in range(tree.size + 1):
            path = [v.tokens[-1]] + [tree.tokens[r - 1] for r in tree.path(row)]
            chain, _ = forward_logits(tiny_pair.target, v.tokens[:-1] + path, None, 1, tiny_pair.vocab_size)
            assert torch.allclose(logits[row], chain[0], atol=1e-5), row
        cache.keep_rows(start, [ROOT, 1, 3])  # root, 5, 7
        kept = [layer.keys[0, :, :].clone() for layer in cache.layers]
        _, fresh = forward_logits(tiny_pair.target, v.tokens[:-1] + [v.tokens[-1], 5, 7], None, 1, tiny_pair.vocab_size)
    assert cache.get_seq_length() == fresh.get_seq_length() == start + 3
    assert all(torch.allclose(k, layer.keys[0], atol=1e-5) for k, layer in zip(kept, fresh.layers))


def test_decoding_with_bushy_trees_emits_what_hf_generate_does(tiny_pair):
    """Greedy decoding where every step verifies a tree: the true continuation hidden in a later
    branch, mixed with wrong branches, or absent. The output equals HF generate's, token for token."""
    from test_speculative import _hf_greedy

    prompt, n = list(range(5, 30)), 40
    want = _hf_greedy(tiny_pair, prompt, n)
    v = _verifier(tiny_pair, prompt)
    out = [v.tokens[-1]]
    gen = torch.Generator().manual_seed(1)
    step = 0
    with torch.inference_mode():
        while len(out) < n and not v.ended:
            done = len(out)
            true = want[done : done + 3]
            tree = DraftTree()
            wrong = [t for t in torch.randperm(tiny_pair.vocab_size, generator=gen).tolist() if t not in true[:1]][:2]
            tree.add(ROOT, _tok(wrong[0]), "draft")  # a wrong branch first, with a child of its own
            tree.add(1, _tok(wrong[1]), "draft")
            if step % 3 != 2 and true:  # the true path second (every third step: no true branch at all)
                row = tree.add(ROOT, _tok(true[0]), "suffix")
                for t in true[1:]:
                    tree.add(row, _tok((t + 1) % tiny_pair.vocab_size), "draft")  # a wrong sibling first
                    row = tree.add(row, _tok(t), "suffix")
            path, emitted = v.verify_tree(tree.check(10_000, tiny_pair.vocab_size))
            out += emitted
            step += 1
            assert v.cache.get_seq_length() == len(v.tokens) - 1
    assert out[:n] == want[:n]


@pytest.mark.slow
def test_on_the_embedded_target_a_tree_row_has_its_chain_reads_bits():
    """fp32 on the row-invariant kernels (where this CPU builds them): every row of one tree read
    equals, bit for bit, the plain read of its own path, and decoding where every step verifies a
    tree emits what plain greedy decoding does."""
    from engine.lab.generation import encode_prompt
    from engine.runtime.forward import forward_logits, forward_tree_logits
    from engine.runtime.kernels import rowdot
    from engine.runtime.models import load_pair

    if rowdot.unavailable() is not None:
        pytest.skip(rowdot.unavailable())
    pair = load_pair(target_tier="fp32", device="cpu")
    prompt = encode_prompt(pair.tokenizer, "Write a Python function that reverses a string.", chat=True)
    v = _verifier(pair, prompt)
    with torch.inference_mode():
        first, _ = forward_logits(pair.target, list(v.tokens), None, 1, pair.vocab_size)  # [1, V]
        top = first[0].topk(3).indices.tolist()
        tree = DraftTree()
        rows = [tree.add(ROOT, _tok(t), "draft") for t in top]  # three first tokens, two more under each
        for r in rows:
            grand = tree.add(r, _tok(top[0]), "draft")
            tree.add(grand, _tok(top[1]), "draft")
        start = len(v.tokens) - 1
        logits, cache = forward_tree_logits(pair.target, [v.tokens[-1]] + tree.tokens, v.cache, tree.mask(),
                                            tree.positions(start), pair.vocab_size)
        for row in range(tree.size + 1):
            path = [v.tokens[-1]] + [tree.tokens[r - 1] for r in tree.path(row)]
            chain, _ = forward_logits(pair.target, v.tokens[:-1] + path, None, 1, pair.vocab_size)
            assert torch.equal(logits[row], chain[0]), row
        cache.crop(-(tree.size + 1))  # back to the context
        plain = _verifier(pair, prompt)
        want = [plain.tokens[-1]]
        while len(want) < 24 and not plain.ended:
            want += plain.verify([])[1]
        out = [v.tokens[-1]]
        while len(out) < 24 and not v.ended:
            nxt = want[len(out) : len(out) + 2]
            t = DraftTree()
            t.add(ROOT, _tok((nxt[0] + 7) % pair.vocab_size), "draft")
            row = t.add(ROOT, _tok(nxt[0]), "draft")
            if len(nxt) > 1:
                t.add(row, _tok(nxt[1]), "draft")
            out += v.verify_tree(t)[1]
    assert out[:24] == want[:24]


@pytest.mark.parametrize("kv_tier", ["fp8", "int8"])
def test_at_a_lossy_kv_tier_tree_steps_store_what_plain_steps_store(tiny_pair, kv_tier):
    """The accepted path's KV moves in its stored form (codes and scales): after tree steps the
    cache holds, bit for bit, what plain steps at the same tier stored, and the output is theirs."""
    prompt, n = list(range(7, 31)), 20
    plain = _verifier(tiny_pair, prompt, kv_tier)
    with torch.inference_mode():
        while len(plain.tokens) - len(prompt) < n and not plain.ended:
            plain.verify([])
        want = plain.tokens[len(prompt):]
        v = _verifier(tiny_pair, prompt, kv_tier)
        while len(v.tokens) < len(plain.tokens) and not v.ended:
            nxt = want[len(v.tokens) - len(prompt):][:2]
            tree = DraftTree()
            tree.add(ROOT, _tok((nxt[0] + 3) % tiny_pair.vocab_size), "draft")
            row = tree.add(ROOT, _tok(nxt[0]), "draft")
            if len(nxt) > 1:
                tree.add(row, _tok(nxt[1]), "draft")
            v.verify_tree(tree)
    assert v.tokens[: len(plain.tokens)] == plain.tokens
    m = min(v.cache.get_seq_length(), plain.cache.get_seq_length())
    for (ka, va), (kb, vb) in zip(v.cache.stored(m), plain.cache.stored(m)):
        assert torch.equal(ka.codes, kb.codes) and torch.equal(ka.scale, kb.scale)
        assert torch.equal(va.codes, vb.codes) and torch.equal(va.scale, vb.scale)



# -- token trees in runs ------------------------------------------------------------------------------


def _tree_run(pair, ids, policy: str, **cfg):
    from engine.decode.policies import make_policy
    from engine.lab.generation import GenConfig, Generation

    return Generation(pair, ids, make_policy(policy), GenConfig(**cfg)).run()


@pytest.mark.parametrize("policy", ["tree:4x2", "tree:16x4", "tree:3x8"])
def test_a_tree_policy_run_emits_what_hf_generate_does(tiny_pair, policy):
    """The draft grows a tree each step (oracles/tree_growth.py), the target verifies it in one
    read: the output is HF generate's, token for token, and each step records the tree's shape."""
    from test_speculative import _hf_greedy

    from engine.decode.tree import DraftTree

    ids = list(range(5, 30))
    gen = _tree_run(tiny_pair, ids, policy, max_new_tokens=40)
    assert gen.token_ids == _hf_greedy(tiny_pair, ids, 40)
    nodes, width = map(int, policy.split(":")[1].split("x"))
    steps = [r for r in gen.records[1:] if r.k_drafted]
    assert steps and all(len(r.tree_parents) == r.k_drafted <= nodes for r in steps)
    for r in steps:
        tree = DraftTree([0] * r.k_drafted, r.tree_parents)
        assert all(len(tree.children(row)) <= width for row in range(tree.size + 1))
        assert r.accepted <= tree.max_depth and r.emitted <= r.accepted + 1
    assert any(r.accepted for r in steps)


def test_tree_growth_takes_the_best_paths_by_cumulative_probability():
    """EAGLE-2's rule on a known law: level by level the most likely children; then the nodes of
    highest path probability, each after its parent and its earlier siblings."""
    from engine.oracles.tree_growth import grow

    vocab = 6
    laws = {(): [0.5, 0.3, 0.2, 0, 0, 0], (0,): [0, 0, 0, 0.9, 0.1, 0], (1,): [0, 0, 0, 0, 0.6, 0.4],
            (0, 3): [0.7, 0, 0, 0, 0, 0.3], (0, 4): [1.0, 0, 0, 0, 0, 0], (1, 4): [0, 0.5, 0.5, 0, 0, 0],
            (1, 5): [0, 0, 0, 0, 0, 1.0]}

    def read(tree, rows):
        out = []
        for r in rows:
            path = tuple(tree.tokens[a - 1] for a in tree.path(r))
            out.append(torch.tensor(laws.get(path, [1.0 / vocab] * vocab)))
        return torch.stack(out)

    tree = grow(read, 4, 2, Sampler(0.0, 1.0, None, torch.device("cpu")), "draft")
    # candidates: 0 (.5), 1 (.3); 0→3 (.45), 0→4 (.05); 1→4 (.18), 1→5 (.12); 0→3→0 (.315) ...
    assert [tree.tokens[r - 1] for r in tree.path(tree.size)] and tree.size == 4
    paths = sorted(tuple(tree.tokens[a - 1] for a in tree.path(r)) for r in range(1, 5))
    assert paths == [(0,), (0, 3), (0, 3, 0), (1,)]


def test_a_tree_policy_with_a_sampling_run_is_reproducible_and_stored(tiny_pair, tmp_path):
    """Sampling: the same seed, the same tree steps and output; the steps keep the trees' shapes in
    the store (schema 13), chains an empty list."""
    from engine.service.generation import Request, keep, open_generation
    from store import Store

    req = Request(prompt="abc def ghi", policy="tree:6x3", max_new_tokens=24, temperature=0.8, seed=7, chat=False)
    runs = [open_generation(tiny_pair, req, context=None) for _ in range(2)]
    for gen in runs:
        list(gen)
    assert runs[0].token_ids == runs[1].token_ids
    db = str(tmp_path / "t.duckdb")
    kept = keep(runs[0], req, db)
    with Store(db) as st:
        steps = st.steps(kept.run_id).sort_values("step")
    want = [r.tree_parents for r in runs[0].records]
    assert [list(p) if p is not None else [] for p in steps["tree_parents"]] == want and any(want)


@pytest.mark.parametrize("policy,says", [
    ("tree:0x3", "node budget N from 1 to 16, got 0"), ("tree:17x3", "got 17"), ("tree:8x1", "width W of at least 2"),
    ("tree:8xa", "takes two integers"), ("tree:8x3@ngram", "grows token trees with the draft model only, not ngram"),
    ("tree:8x99999", "width must be from 1 to the vocabulary"),
])
def test_a_tree_policy_the_run_cannot_take_is_refused_in_one_line(tiny_pair, policy, says):
    with pytest.raises(ValueError, match=says) as e:
        _tree_run(tiny_pair, [5, 6, 7], policy, max_new_tokens=8)
    assert "\n" not in str(e.value)


def test_a_tree_policy_on_llamacpp_is_refused_in_one_line(tiny_pair):
    """llama.cpp verifies chains only (a trace without trees: test_lab.py)."""
    import dataclasses

    from engine.lab.generation import check_tree_run

    with pytest.raises(ValueError, match="llamacpp engine verifies chains only") as e:
        check_tree_run(dataclasses.replace(tiny_pair, engine="llamacpp"), "tree:8x3", 8, 3, [])
    assert "\n" not in str(e.value)


def test_a_grown_tree_of_n_nodes_is_the_first_n_rows_of_a_larger_one():
    """Levels are read only while the selection may use them, so every node budget at one width
    takes a prefix of one best-first order: what a trace can record once for every tree policy.
    A shallow budget reads fewer levels than a deep one."""
    from engine.oracles.tree_growth import grow

    vocab = 7

    def law(path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(path) % (2**31))
        return torch.softmax(3 * torch.randn(vocab, generator=g), -1)

    for width in (2, 3):
        levels: dict[int, int] = {}

        def read(tree, rows, budget):
            levels[budget] = levels.get(budget, 0) + 1
            return torch.stack([law(tuple(tree.tokens[a - 1] for a in tree.path(r))) for r in rows])

        greedy = Sampler(0.0, 1.0, None, torch.device("cpu"))
        big = grow(lambda t, r: read(t, r, 16), 16, width, greedy, "draft")
        for n in range(1, 16):
            small = grow(lambda t, r: read(t, r, n), n, width, greedy, "draft")
            assert small.tokens == big.tokens[:n] and small.parents == big.parents[:n], (width, n)
        assert levels[1] == 1 and levels[2] <= levels[16] and levels[16] <= 8


def test_acceptance_by_rank_and_the_static_tree_it_gives():
    """How often the target took each rank's child of a reached node; the N best rank paths (EAGLE's
    tree_choices form) under those rates, each after its parent and lower ranks."""
    from engine.decode.tree import rank_acceptance, static_choices

    steps = [([0, 0, 1, 1, 2], [5, 6, 7, 8, 7], [6, 7]),  # root → rank 1 → its rank 0 → a leaf
             ([0, 0], [1, 2], [])]  # root reached, nothing taken
    assert rank_acceptance(steps, 3) == ([1 / 3, 1 / 2, 0.0], 3)
    assert static_choices([0.6, 0.24, 0.096], 8, 3, 8) == [(0,), (0, 0), (1,), (0, 0, 0), (0, 1), (1, 0),
                                                          (0, 0, 0, 0), (2,)]
    assert static_choices([0.9, 0.05], 4, 2, 2) == [(0,), (0, 0), (1,), (0, 1)]  # depth 2 at most
    assert static_choices([0.6], 3, 3, 8) == [(0,), (0, 0), (0, 0, 0)]  # one rank known: a chain


def _rakv_state(width: int, alpha: float = 0.6):
    from engine.decode.records import DecodeState

    return DecodeState(step=1, position=1, context_len=10, remaining=50, target_tier="fp32", kv_tier="native",
                       alpha_ewma=alpha, alpha_trials=20.0, tree_width=width)


def _table(verify0: float, per_row: float, draft_ms: float = 1.0, trees: bool = True):
    """One bucket: a verify of k + 1 rows costs verify0 + k·per_row, a tree's level 1.5 drafted
    tokens, a 16-node tree's verify what the line gives it (`trees` False: no tree figures)."""
    from engine.decode.costs import CostTable
    from engine.decode.records import K_MAX, TREE_MAX_NODES

    figures = dict(tree_level_ms=[1.5 * draft_ms], tree_verify_ms=[verify0 + TREE_MAX_NODES * per_row]) if trees else {}
    return CostTable([1], [draft_ms], [[verify0 + k * per_row for k in range(K_MAX + 1)]], **figures)


def test_rakv_drafts_a_tree_where_a_wide_verify_is_cheap_and_a_chain_where_it_is_not():
    """rakv weighs trees of 4, 8 and 16 nodes beside its chains where the run grows trees: with a
    verify that costs the same at 17 rows as at 1 (a GPU's) it drafts a tree and says its shape;
    where each row costs a fifth of a plain step (a small CPU's), a chain; without trees, or on a
    table that did not time them, never one."""
    from engine.decode.policies.rakv import RakvPolicy

    flat = RakvPolicy(_table(10.0, 0.05))
    action = flat.choose(_rakv_state(3))
    assert action.width == 3 and action.k in (4, 8, 16) and action.proposer == "draft"
    assert flat.why.startswith(f"draft tree {action.k}×3") and "E ≈" in flat.why and "for a chain of" in flat.why
    steep = RakvPolicy(_table(10.0, 2.0))
    chain = steep.choose(_rakv_state(3))
    assert chain.width == 1 and chain.k > 0
    assert RakvPolicy(_table(10.0, 0.05)).choose(_rakv_state(0)).width == 1
    unpriced = RakvPolicy(_table(10.0, 0.05, trees=False))
    assert unpriced._best_tree(_rakv_state(3), 0.6) is None and unpriced.choose(_rakv_state(3)).width == 1


def test_rakv_learns_each_ranks_acceptance_from_its_tree_steps():
    """A run whose target keeps taking the draft's second guess raises rank 1's rate, so the
    tree rakv expects more tokens from grows wider at the root."""
    from engine.decode.policies.rakv import RakvPolicy
    from engine.decode.records import StepRecord

    policy = RakvPolicy(_table(10.0, 0.05))
    before = policy._best_tree(_rakv_state(3), 0.6)
    for step in range(1, 9):  # root ─ {5, 6}: the target takes 6, the second child, every time
        policy.observe(StepRecord(step=step, position=step, k_chosen=2, k_drafted=2, accepted=1, emitted=2,
                                  token_ids=[6, 9], mean_entropy=0.5, max_entropy=0.5, mean_confidence=0.5,
                                  min_confidence=0.5, entropies=[0.5, 0.5], confidences=[0.5, 0.5], draft_ms=1.0,
                                  verify_ms=10.0, decide_ms=0.0, context_len=10, target_tier="fp32",
                                  kv_tier="native", proposer="draft", tree_parents=[0, 0], draft_ids=[5, 6]))
    assert policy._ranks[0].alpha == 1.0
    after = policy._best_tree(_rakv_state(3), 0.6)
    assert after[2] > before[2]  # more tokens expected a verify
    policy.reset()
    assert policy._ranks == []
