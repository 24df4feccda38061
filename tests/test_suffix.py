"""The suffix proposer (SuffixDecoding): its proposals against a brute-force count of the streams,
the count trie's two builders against each other, frequency scoring, the cross-request history
(LRU budget, snapshots, leave-one-out), its options, and with the tiny pair: exact greedy decoding,
exact sampling, Compare's shared history, and replay of a trace taking the live run's steps."""
import random

import pytest
import torch
from test_ngram import copy_context, two_token_law_holds
from test_speculative import PROMPTS, _hf_greedy

from engine.decode.policies import BasePolicy, make_policy, parse_policy
from engine.decode.records import K_MAX, Action
from engine.decode.step import ModelledClock, Setting, decode
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.lab.profiling import trace
from engine.lab.whatif import proposals, replay
from engine.oracles import available
from engine.oracles.ngram import NgramProposer
from engine.oracles.sampling import Sampler
from engine.oracles.suffix import DEPTH, CountTrie, SuffixHistory, SuffixProposer, _push_stream, _trie_of, prompt_key
from engine.oracles.trace import TraceVerifier

GREEDY = Sampler(0.0, 1.0, None, torch.device("cpu"))
V = 64


def _always(j, token) -> bool:
    return True


def _ids(p: SuffixProposer, k: int = 8) -> list[int]:
    return [d.token_id for d in p.propose(k, _always)]


def _suffix(ctx, history=None, sampler=GREEDY, vocab_size=V, **kw) -> SuffixProposer:
    return SuffixProposer(list(ctx), sampler, vocab_size, history, **kw)


# -- the definition, by brute force -----------------------------------------------------------------
def _followers(streams, s: tuple, depth: int) -> tuple[dict, dict]:
    """Count of each token after n-gram s (s·t counted only while it has ≤ depth tokens), and
    where each last followed it."""
    count, last = {}, {}
    if len(s) + 1 > depth:
        return count, last
    for i, st in enumerate(streams):
        for j in range(len(st) - len(s)):
            if tuple(st[j : j + len(s)]) == s:
                t = st[j + len(s)]
                count[t], last[t] = count.get(t, 0) + 1, (i, j)
    return count, last


def _back_off(streams, s: tuple, depth: int) -> tuple:
    while s and not _followers(streams, s, depth)[0]:
        s = s[1:]
    return s


def _brute_path(streams, s: tuple, depth: int, min_prob: float) -> tuple[list[int], float]:
    """From context suffix s: the most frequent follower (the latest on a tie), the running
    product of count ratios ≥ min_prob, at most min(K_MAX, len(s)) tokens, backing off to the
    longest suffix with a follower after each."""
    out, p, score, cap = [], 1.0, 0.0, min(K_MAX, len(s))
    while len(out) < cap:
        s = _back_off(streams, s, depth)
        if not s:
            break
        count, last = _followers(streams, s, depth)
        top = max(count.values())
        t = max((t for t in count if count[t] == top), key=last.get)
        r = count[t] / sum(count.values())
        if p * r < min_prob:
            break
        p *= r
        score += p
        out.append(t)
        s += (t,)
    return out, score


def _brute(ctx: list[int], history: list[list[int]], depth: int, min_prob: float) -> list[int]:
    own = _back_off([ctx], tuple(ctx[-depth:]), depth)
    present = next((tuple(ctx[-n:]) for n in range(min(depth, len(ctx)), 0, -1)
                    if any(tuple(h[j : j + n]) == tuple(ctx[-n:]) for h in history for j in range(len(h) - n + 1))), ())
    mine, theirs = _brute_path([ctx], own, depth, min_prob), _brute_path(history, _back_off(history, present, depth),
                                                                         depth, min_prob)
    return (mine if mine[1] >= theirs[1] else theirs)[0]


def test_proposals_are_the_brute_force_counts_step_by_step():
    """Random streams and histories (small alphabets: repeats and ties abound), fed as steps: each
    proposal, its lookahead and every shorter proposal are the definition's."""
    checks = 0
    for seed in range(250):
        rng = random.Random(seed)
        alphabet, depth, prob = rng.randint(1, 5), rng.randint(1, 6), rng.choice([0.05, 0.1, 0.3, 0.6])
        past = [[rng.randrange(alphabet) for _ in range(rng.randint(0, 12))] for _ in range(rng.randint(0, 3))]
        history = SuffixHistory.from_outputs([(str(i), s) for i, s in enumerate(past)], depth=depth)
        ctx = [rng.randrange(alphabet) for _ in range(rng.randint(0, 8))]
        p = _suffix(ctx, history, depth=depth, min_prob=prob)
        for _ in range(rng.randint(1, 20)):
            want = _brute(ctx, past, depth, prob)
            assert _ids(p) == want, (seed, ctx, past, depth, prob)
            assert p.lookahead() == len(want)
            k = rng.randint(0, 8)
            assert _ids(p, k) == want[:k]  # propose(k) is the first min(k, m) of the path: replay holds
            n = rng.randint(0, len(want))
            emitted = want[:n] + [rng.randrange(alphabet)]
            p.update(n, emitted)
            ctx += emitted
            assert p.tokens == ctx
            checks += 1
    assert checks > 2000


def _canonical(trie: CountTrie) -> dict:
    """n-gram → (count, total, best child's n-gram, link's n-gram, level): the trie without its ids."""
    parent = {c: (key >> 32, key & 0xFFFFFFFF) for key, c in trie.child.items()}
    gram = {0: ()}
    for v in sorted(parent, key=lambda v: trie.level[v]):
        gram[v] = gram[parent[v][0]] + (parent[v][1],)
    return {gram[v]: (trie.count[v] if v else None, trie.total[v], gram[trie.best[v]] if trie.best[v] else None,
                      gram[trie.link[v]], trie.level[v]) for v in range(trie.nodes + 1)}


def test_the_numpy_builder_makes_the_trie_pushing_makes():
    for seed in range(200):
        rng = random.Random(seed)
        alphabet, depth = rng.randint(1, 6), rng.randint(1, 7)
        streams = [tuple(rng.randrange(alphabet) for _ in range(rng.randint(0, 15))) for _ in range(rng.randint(0, 4))]
        pushed = CountTrie(depth)
        for s in streams:
            _push_stream(pushed, s)
        assert _canonical(_trie_of(streams, depth)) == _canonical(pushed), (seed, streams, depth)


# -- scoring, lengths, bookkeeping --------------------------------------------------------------------
def test_the_most_frequent_continuation_wins_where_prompt_lookup_takes_the_latest():
    ctx = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]  # [1, 2] went on to 3 twice, to 4 once (the latest)
    assert _ids(_suffix(ctx, min_prob=0.1)) == [3, 9]  # a 2-token match drafts ≤ 2: 3 (2/3), then 9 (2/2)
    assert [d.token_id for d in NgramProposer(ctx, GREEDY, V).propose(3, _always)] == [4, 7, 1]
    p = _suffix(ctx, min_prob=0.1)
    (d,) = p.propose(1, _always)
    assert d.confidence == pytest.approx(2 / 3) and 0.9 < d.entropy < 0.92  # H(2/3, 1/3) = 0.918 bits
    assert _ids(_suffix(ctx, min_prob=0.7)) == []  # 2/3 < 0.7: nothing is worth drafting


def test_the_path_lengthens_with_the_match_and_stops_at_doubt():
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert _ids(_suffix([*text, 1, 5])) == [6]  # a 1-token match drafts at most one token
    assert _ids(_suffix([*text, 1, 5, 6, 7])) == [8, 9, 10]  # three matched, three drafted
    assert _ids(_suffix([*text, 1, *text[:9]])) == [14, 1, 5, 6, 7, 8, 9, 10]  # K_MAX, on round the repeat
    forks = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # three continuations seen once each: 1/3 each, the latest first
    assert _ids(_suffix(forks, min_prob=0.3)) == [5, 1] and _ids(_suffix(forks, min_prob=0.4)) == []


def test_propose_changes_nothing_and_update_extends_the_context():
    p = _suffix([1, 2, 3, 4, 5, 1, 2, 3])
    drafted = _ids(p, 4)
    assert drafted == [4, 5, 1] and _ids(p, 4) == drafted  # a dropped proposal needs no rollback
    assert p.lookahead() == 3 and p.unread == (0, 0) and p.name == "suffix"
    p.update(2, [4, 5, 9])
    assert p.tokens == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 9] and _ids(p) == []  # 9 is new
    p.update(0, [1, 2])
    assert _ids(p) == [3, 4]


def test_draft_tokens_are_one_hot_under_sampling_and_lawless_when_greedy():
    assert all(d.p is None for d in _suffix([1, 2, 1]).propose(1, _always))
    sampled = _suffix([1, 2, 3, 1, 2], sampler=Sampler(0.8, 1.0, 0, torch.device("cpu"))).propose(2, _always)
    assert [d.token_id for d in sampled] == [3, 1]
    for d in sampled:
        assert d.p.shape == (V,) and d.p[d.token_id] == 1.0 and d.p.sum() == 1.0


def test_tokens_past_the_vocabulary_end_the_draft():
    assert _ids(_suffix([5, 6, V + 3, 7, 5, 6], vocab_size=V)) == []
    assert _ids(_suffix([5, 6, 7, V + 3, 5, 6, 7], vocab_size=V)) == []
    assert _ids(_suffix([4, 5, 6, 7, V, 4, 5, 6], vocab_size=V)) == [7]


# -- the cross-request history --------------------------------------------------------------------------
def _replay_tau(output: list[int], prompt: list[int], history: SuffixHistory | None, k: int = 4) -> float:
    """τ of fixed:k with the suffix proposer over a known greedy output (the trace verifier emits
    it: what a live greedy run emits, whatever drafts)."""

    class Fixed(BasePolicy):
        name = f"fixed:{k}"

        def choose(self, state):
            return Action(k, proposer="suffix")

    proposer = {"suffix": SuffixProposer(prompt, GREEDY, 10_000, history)}
    recs = list(decode(proposer, TraceVerifier(output, len(prompt)), Fixed(), Setting(len(prompt), len(output), "fp32",
                                                                                       "native"), ModelledClock()))
    return sum(r.emitted for r in recs[1:]) / (len(recs) - 1)


def _function(rng: random.Random, name: int) -> list[int]:
    """A synthetic 'function' of a code answer: a fixed skeleton around a few varying tokens."""
    a, b = rng.randrange(500, 600), rng.randrange(600, 700)
    return [100, 101, name, 102, 103, a, 104, 105, 106, 107, b, 108, 109, 110, 111, 112, 113, 114, 115, name, 116]


def test_a_history_of_other_requests_raises_tau_on_repeated_structure():
    rng = random.Random(0)
    earlier = [(f"req{i}", [t for f in range(3) for t in _function(rng, 1000 + 10 * i + f)]) for i in range(6)]
    prompt, output = [7, 8, 9], [t for f in range(2) for t in _function(rng, 2000 + f)]
    history = SuffixHistory.from_outputs(earlier)
    cold, warm = _replay_tau(output, prompt, None), _replay_tau(output, prompt, history)
    assert warm > cold + 0.3, (cold, warm)  # measured: cold 1.28, warm 1.78
    assert _replay_tau(output, prompt, history.without("req0")) > cold + 0.3  # leaving one out keeps the rest


def test_the_budget_evicts_least_recently_used_and_is_never_exceeded():
    rng = random.Random(1)
    h = SuffixHistory(budget=100)
    for i in range(40):
        key = f"r{rng.randrange(12)}"
        h.add(key, [rng.randrange(50) for _ in range(rng.randint(1, 60))])
        assert h.tokens <= 100 and h.keys()[-1] == key  # the newest is kept, once
        assert _canonical(h.trie) == _canonical(_trie_of([h._requests[k] for k in h.keys()], DEPTH))
    h.add("long", list(range(300)))
    assert h.keys() == ["long"] and h.tokens == 100  # a request over the budget keeps its last tokens
    h = SuffixHistory(budget=10)
    for key in "abcd":
        h.add(key, [ord(key)] * 3)
    assert h.keys() == ["b", "c", "d"]  # d would make 12: evicted down to ¾ of the budget less d, oldest first
    h.add("c", [1, 2])
    assert h.keys() == ["b", "d", "c"] and h.tokens == 8  # a prompt asked again: the newest, with its new output


@pytest.mark.parametrize("make, msg", [
    (lambda: SuffixHistory(budget=0), "the suffix history budget must be a positive number of tokens, got 0"),
    (lambda: SuffixHistory(budget=-5), "got -5"),
    (lambda: _suffix([1], budget=0), "suffix option budget must be a positive number of tokens, got 0"),
    (lambda: _suffix([1], depth=0), r"suffix option depth must be an integer in \[1, 64\], got 0"),
    (lambda: _suffix([1], min_prob=0.0), r"suffix option prob must be a number in \(0, 1\], got 0.0"),
    (lambda: SuffixProposer.from_options([1], GREEDY, V, {"n": "2"}),
     r"unknown suffix option 'n' \(known: budget, depth, prob\)"),
    (lambda: SuffixProposer.from_options([1], GREEDY, V, {"depth": "x"}),
     "suffix option depth must be an integer, got 'x'"),
    (lambda: parse_policy("fixed:4@suffix:budget=0"),
     "proposer suffix: option budget must be a positive integer, got '0'"),
    (lambda: parse_policy("fixed:4@suffix:size=3"),
     "unknown option 'size' for proposer suffix; known: budget, depth, prob"),
    (lambda: SuffixHistory().snapshot().add("k", [1]), "a suffix history snapshot never changes"),
])
def test_bad_budgets_and_options_are_one_line_value_errors(make, msg):
    with pytest.raises(ValueError, match=msg) as e:
        make()
    assert "\n" not in str(e.value)


def test_options_as_the_policy_spec_writes_them():
    h = SuffixHistory.from_outputs([("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])])
    p = SuffixProposer.from_options([9], GREEDY, V, {"budget": "5", "depth": "4", "prob": "0.5"}, h)
    assert (p._own.depth, p.min_prob, p.history.keys(), p.history.frozen) == (4, 0.5, ["b"], True)
    spec = make_policy("fixed:4@suffix:budget=5,prob=0.5")
    assert spec.proposer_options == {"suffix": {"budget": "5", "prob": "0.5"}}


def test_a_snapshot_never_changes_and_costs_no_copy_once_released():
    h = SuffixHistory.from_outputs([("a", [1, 2, 3, 1, 2, 4])])
    snap = h.snapshot()
    shared = h.trie
    assert snap.trie is shared and snap.frozen and not h.frozen
    before = snap.describe()
    h.add("b", [1, 2, 3, 5])
    assert snap.describe() == before and snap.trie is shared and h.trie is not shared  # copied: the snapshot reads it
    assert _ids(_suffix([9, 1, 2, 3], snap)) == [1, 2, 4]  # as it stood
    assert _ids(_suffix([9, 1, 2, 3], h.snapshot())) == [5]  # 1 and 5 once each after [1, 2, 3]: the latest, 1/2
    assert h.describe()["requests"] == 2 and before["requests"] == 1
    del snap
    kept = h.trie
    h.add("c", [7, 7])
    assert h.trie is kept  # no snapshot held any more: extended in place


# -- with the tiny model pair ------------------------------------------------------------------------
def _prompt_ids(pair, prompt: str) -> list[int]:
    return encode_prompt(pair.tokenizer, prompt, chat=True)


def test_suffix_is_available_on_every_pair(tiny_pair):
    assert available(tiny_pair) == ("draft", "ngram", "suffix")


@pytest.fixture(scope="module")
def ctx():
    """rakv's context: costs (made up, so that its choices do not move with the machine's load)
    that make the lookups free and a verified token dear; a synthetic table prices the draft alone."""
    from engine.decode.costs import CostTable, DraftCost
    from tiny import synthetic_context

    made = synthetic_context()
    costs = CostTable([1], [1.0], [[10.0 + 3.0 * k for k in range(K_MAX + 1)]],
                      proposer_costs={"ngram": DraftCost([0.0]), "suffix": DraftCost([0.0])})
    return type(made)(costs=costs, controller=made.controller)


@pytest.mark.parametrize("spec", ["fixed:4@suffix", "fixed:8@suffix:prob=0.05", "rakv@suffix", "rakv"])
def test_greedy_output_with_suffix_drafts_is_plain_greedy_cold_and_warm(tiny_pair, ctx, spec):
    outputs = {}
    for prompt in PROMPTS[1:3]:  # the history a warm run reads: every prompt's output, its own included
        ids = _prompt_ids(tiny_pair, prompt)
        outputs[prompt_key(ids)] = _hf_greedy(tiny_pair, ids, 40)
    warm = SuffixHistory.from_outputs(outputs.items())
    accepted = 0
    for prompt in PROMPTS[1:3]:
        ids = _prompt_ids(tiny_pair, prompt)
        for history in (None, warm):
            g = Generation(tiny_pair, ids, make_policy(spec, ctx), GenConfig(max_new_tokens=40), history=history).run()
            assert g.token_ids == outputs[prompt_key(ids)], (spec, prompt, history is None)
            assert g.proposers == (("suffix",) if "@" in spec else available(tiny_pair))
            accepted += sum(r.accepted for r in g.records if r.proposer == "suffix")
    assert accepted > 20  # the warm runs find their own outputs


def test_a_live_history_is_fed_each_finished_run(tiny_pair):
    h = SuffixHistory()
    ids = _prompt_ids(tiny_pair, PROMPTS[1])
    first = Generation(tiny_pair, ids, make_policy("fixed:4@suffix"), GenConfig(max_new_tokens=24), history=h).run()
    assert h.keys() == [prompt_key(ids)] and h.tokens == len(first.token_ids)
    again = Generation(tiny_pair, ids, make_policy("fixed:4@suffix"), GenConfig(max_new_tokens=24), history=h).run()
    assert again.token_ids == first.token_ids and len(h) == 1  # asked again: replaced, not doubled
    assert again.summary.tokens_per_step > first.summary.tokens_per_step  # it found its earlier output


def test_sampling_with_suffix_drafts_follows_the_target_law(tiny_pair):
    """As the n-gram proposer's end-to-end test, the two tokens drafted from the history: its
    [tail[-1], a] is a 2-token match followed by [v, tail[0]] (this request's own match, [a],
    drafts v alone, and scores less)."""
    c = copy_context(tiny_pair)
    history = SuffixHistory.from_outputs([("other", [c["tail"][-1], c["a"], c["v"], c["tail"][0]])])
    two_token_law_holds(c, SuffixProposer(c["ids"], c["sampler"], c["pair"].vocab_size, history))


def test_a_comparison_starts_every_policy_from_the_same_history(tiny_pair):
    from engine.service.generation import Request, run_policies

    prompt, specs = PROMPTS[1], ["fixed:4@suffix", "fixed:3@suffix"]
    ids = _prompt_ids(tiny_pair, prompt)
    h = SuffixHistory.from_outputs([("other", [5, 6, 7])])
    before = h.snapshot()
    req = Request("", max_new_tokens=24)
    results = run_policies(tiny_pair, [prompt], specs, req, lambda s: None, history=h)
    for spec, res in zip(specs, results):  # each as if run alone on the history before the comparison
        alone = Generation(tiny_pair, ids, make_policy(spec), GenConfig(max_new_tokens=24), history=before).run()
        assert [(s["k_drafted"], s["accepted"]) for s in res.steps] == [(r.k_drafted, r.accepted)
                                                                         for r in alone.records]
    assert h.keys() == ["other", prompt_key(ids)]  # fed once, after the comparison
    assert h.without(prompt_key(ids)).keys() == ["other"]
    # Fed after each run instead, the second policy would have found the first one's output.
    fed = SuffixHistory.from_outputs([("other", [5, 6, 7]), (prompt_key(ids), results[0].token_ids)])
    leaked = Generation(tiny_pair, ids, make_policy(specs[1]), GenConfig(max_new_tokens=24), history=fed).run()
    assert sum(r.accepted for r in leaked.records) > sum(s["accepted"] for s in results[1].steps)


@pytest.mark.parametrize("spec", ["fixed:4@suffix", "rakv@suffix", "rakv", "threshold:0.6@suffix"])
def test_replay_of_a_trace_with_a_history_takes_the_live_steps(tiny_pair, ctx, spec):
    prompts = [PROMPTS[1], PROMPTS[3]]
    earlier = [(prompt_key(x), _hf_greedy(tiny_pair, x, 30)) for x in (_prompt_ids(tiny_pair, p) for p in PROMPTS)]
    history = SuffixHistory.from_outputs(earlier[:2])  # one of the two traced prompts finds its output there
    by = set()
    for prompt in prompts:
        t = trace(tiny_pair, prompt, "chat", 30, history=history)
        assert t.row["config"]["suffix_history"] == history.describe()
        sfx = proposals(t.positions)["suffix"]
        assert all(len(r["draft_ids"]) == r["lookahead"] for r in sfx.values())
        live = Generation(tiny_pair, _prompt_ids(tiny_pair, prompt), make_policy(spec, ctx),
                          GenConfig(max_new_tokens=30), history=history).run()
        rep = replay(make_policy(spec, ctx), t.row, t.positions, ctx.costs)
        assert live.token_ids == t.row["token_ids"]
        assert [(r.proposer, r.k_chosen, r.k_drafted, r.accepted, r.emitted, r.confidences) for r in rep.steps] == [
            (r.proposer, r.k_chosen, r.k_drafted, r.accepted, r.emitted, r.confidences) for r in live.records], spec
        by |= {r.proposer for r in live.records if r.accepted}
    assert "suffix" in by, by  # its drafts stood somewhere: the replay checked them


def test_cli_refuses_a_bad_suffix_budget_before_loading_models(capsys):
    from engine.cli.main import main

    assert main(["generate", "--prompt", "hi", "--suffix-budget", "0", "--db", ""]) == 2
    assert capsys.readouterr().err.strip() == "error: --suffix-budget must be a positive number of tokens, got 0"
    assert main(["generate", "--prompt", "hi", "--policy", "fixed:4@suffix:budget=-1", "--db", ""]) == 2
    assert "option budget must be a positive integer, got '-1'" in capsys.readouterr().err


def test_a_process_history_starts_from_the_stored_runs(tiny_pair, tmp_path):
    from engine.service.generation import Request, generate, suffix_history

    db = str(tmp_path / "runs.duckdb")
    assert len(suffix_history(db, tiny_pair, 50)) == 0  # no file: empty, and none made
    outs = [generate(tiny_pair, Request(p, "ar", max_new_tokens=12), db, context=None)[0] for p in PROMPTS[:3]]
    h = suffix_history(db, tiny_pair, 30)
    assert h.tokens <= 30 and h.keys()[-1] == prompt_key(outs[-1].prompt_ids)  # the newest that fit
    assert h._requests[h.keys()[-1]] == tuple(outs[-1].token_ids)
