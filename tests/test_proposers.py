"""Several proposers in one run (docs/architecture.md, "The step", "Traces and replay"): the step
loop drafts with the one the policy names and tells every one each outcome; greedy output stays
the target's whatever drafts; traces record every proposer, and replay of policies choosing
among them takes the live run's steps; per-proposer costs; the policy spec's '@' part."""
import pytest
import torch
from test_speculative import _hf_greedy

from engine.decode.costs import CostTable, DraftCost, calibrate
from engine.decode.policies import BasePolicy, make_policy, parse_policy
from engine.decode.records import K_MAX, UNBOUNDED, Action
from engine.decode.step import Setting, decode
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.lab.profiling import measure_costs, trace
from engine.lab.whatif import proposals, replay
from engine.oracles import available, build
from engine.oracles.sampling import Sampler
from engine.oracles.target import TargetVerifier

# Prompts that repeat themselves, so that the n-gram proposer finds matches.
PROMPTS = [("code", "def add(a, b): return a + b\ndef sub(a, b): return a - b\ndef mul(a, b):"),
           ("chat", "the cat sat on the mat. the cat sat on the"), ("math", "1 2 3 1 2 3 1 2 3 1 2")]
MAX_NEW = 40


class Alternate(BasePolicy):
    """Chooses among the run's proposers by what the state says: ngram where it has a match on
    odd steps, the draft model otherwise, plain decoding every fifth step. It notes what each
    decision saw of the proposers."""

    name = "alternate"

    def __init__(self):
        self.seen = []

    def choose(self, state):
        self.seen.append((state.proposers, state.lookahead, state.unread, state.alphas, state.draft_unread))
        if state.step % 5 == 0:
            return Action(0)
        if state.step % 2 and state.lookahead.get("ngram", 0) > 0:
            return Action(3, proposer="ngram")
        return Action(1 + state.step % 4, proposer="draft")


def _ids(pair, prompt):
    return encode_prompt(pair.tokenizer, prompt, chat=True)


@pytest.fixture(scope="module")
def lab(tiny_pair):
    traces = [trace(tiny_pair, p, task, MAX_NEW) for task, p in PROMPTS]
    costs = measure_costs(tiny_pair, buckets=(8, 32), reps=2)
    return traces, costs


def test_every_proposer_hears_every_step_and_records_name_the_drafter(tiny_pair):
    ids = _ids(tiny_pair, PROMPTS[2][1])
    sampler = Sampler(0.0, 1.0, None, tiny_pair.device)
    verifier = TargetVerifier(tiny_pair, ids, sampler)
    props = build(tiny_pair, ids, sampler, verifier, None)
    assert list(props) == ["draft", "ngram", "suffix"] == list(available(tiny_pair))  # no EAGLE head on the tiny pair
    seen = []

    class Watch(Alternate):
        def choose(self, state):
            seen.append((state.proposers, dict(state.lookahead), dict(state.unread), dict(state.alphas)))
            return super().choose(state)

    with torch.inference_mode():
        recs = list(decode(props, verifier, Watch(), Setting(len(ids), MAX_NEW, "fp32", "native"), lambda: 0.0))
    out = [t for r in recs for t in r.token_ids]
    assert out == _hf_greedy(tiny_pair, ids, MAX_NEW)
    assert props["ngram"].tokens == ids + out == props["suffix"].tokens  # told every step, the draft model's included
    draft = props["draft"]
    assert draft.cache.get_seq_length() + len(draft.pending) == len(ids) + len(out)
    by = {r.proposer for r in recs}
    assert by == {"", "draft", "ngram"}
    assert all((r.proposer == "") == (r.k_drafted == 0) for r in recs)
    assert all(s[0] == ("draft", "ngram", "suffix") and s[1]["draft"] == UNBOUNDED and s[1]["ngram"] in (0, UNBOUNDED)
               and 0 <= s[1]["suffix"] <= K_MAX for s in seen)
    assert all(s[2]["ngram"] == s[2]["suffix"] == (0, 0) for s in seen) and seen[0][2]["draft"] == (len(ids), 0)
    assert {p for s in seen for p in s[3]} == {"draft", "ngram"}  # per-proposer EWMAs, once each drafted


@pytest.mark.parametrize("spec", ["fixed:4@ngram", "fixed:3@ngram:max=2,min=1", "fixed:2@draft", "ar@ngram",
                                  "heuristic@ngram", "threshold:0.5@ngram", "rules@draft"])
def test_greedy_output_is_the_targets_whatever_proposes(tiny_pair, spec):
    for _, prompt in PROMPTS:
        ids = _ids(tiny_pair, prompt)
        g = Generation(tiny_pair, ids, make_policy(spec), GenConfig(max_new_tokens=MAX_NEW)).run()
        assert g.token_ids == _hf_greedy(tiny_pair, ids, MAX_NEW), (spec, prompt)
        name = spec.split("@")[1].split(":")[0]
        assert g.proposers == (name,) and {r.proposer for r in g.records} <= {"", name}


def test_a_policy_choosing_among_proposers_decodes_exactly_and_drafts_with_both(tiny_pair):
    drafted = set()
    for _, prompt in PROMPTS:
        ids = _ids(tiny_pair, prompt)
        g = Generation(tiny_pair, ids, Alternate(), GenConfig(max_new_tokens=MAX_NEW)).run()
        assert g.token_ids == _hf_greedy(tiny_pair, ids, MAX_NEW)
        drafted |= {r.proposer for r in g.records if r.accepted}
    assert drafted == {"draft", "ngram"}  # both had tokens accepted somewhere


def test_traces_hold_every_proposers_proposal_at_every_position(lab):
    traces, _ = lab
    for t in traces:
        out = t.row["token_ids"]
        by = proposals(t.positions)
        assert list(by) == ["draft", "ngram", "suffix"] == t.row["config"]["proposers"]
        for name, at in by.items():
            assert sorted(at) == list(range(1, len(out)))
            for p, r in at.items():
                n = r["accept_len"]
                assert r["draft_ids"][:n] == out[p : p + n] and r["proposer"] == name
                assert n == len(r["draft_ids"]) or p + n == len(out) or r["draft_ids"][n] != out[p + n]
        assert all(len(r["draft_ids"]) == 8 and r["lookahead"] == UNBOUNDED for r in by["draft"].values())
        assert all(len(r["draft_ids"]) == (8 if r["lookahead"] else 0) for r in by["ngram"].values())
        assert all(len(r["draft_ids"]) == r["lookahead"] <= 8 for r in by["suffix"].values())  # its path, whole
        assert t.row["config"]["suffix_history"]["requests"] == 0  # traced without a history
    ngram = [r for t in traces for r in proposals(t.positions)["ngram"].values()]
    assert any(r["accept_len"] > 0 for r in ngram) and any(r["lookahead"] == 0 for r in ngram)


@pytest.mark.parametrize("spec", ["alternate", "fixed:4@ngram", "heuristic@ngram", "fixed:3", "rakv", "rakv@ngram",
                                  "speckv"])
def test_replay_of_a_policy_choosing_proposers_takes_the_live_steps(tiny_pair, lab, spec):
    from tiny import synthetic_context

    traces, costs = lab
    ctx = synthetic_context()
    ctx = type(ctx)(costs=costs, controller=ctx.controller)  # measured, so ngram is priced
    make = (lambda: Alternate()) if spec == "alternate" else (lambda: make_policy(spec, ctx))
    for t in traces:
        live = Generation(tiny_pair, _ids(tiny_pair, t.row["prompt"]), make(), GenConfig(max_new_tokens=MAX_NEW)).run()
        rep_policy = make()
        rep = replay(rep_policy, t.row, t.positions, costs)
        assert live.token_ids == t.row["token_ids"]
        assert [(r.proposer, r.k_chosen, r.k_drafted, r.accepted, r.emitted) for r in rep.steps] == [
            (r.proposer, r.k_chosen, r.k_drafted, r.accepted, r.emitted) for r in live.records], spec
        assert [r.entropies for r in rep.steps] == [r.entropies for r in live.records]
        assert rep.decode_ms > 0
        if spec == "alternate":  # each decision saw the same of every proposer: lookahead, unread, EWMAs
            assert live.policy.seen == rep_policy.seen and len(live.policy.seen) == len(rep.steps) - 1


def test_replay_refuses_a_proposer_the_trace_lacks(lab):
    traces, costs = lab
    t = traces[0]
    draft_only = [r for r in t.positions if r["proposer"] == "draft"]
    with pytest.raises(ValueError, match="holds no proposals of ngram") as e:
        replay(make_policy("fixed:2@ngram"), t.row, draft_only, costs)
    assert "\n" not in str(e.value)
    old = [{k: v for k, v in r.items() if k not in ("proposer", "lookahead")} for r in draft_only]  # before proposers
    a = replay(make_policy("fixed:2"), t.row, old, costs)
    b = replay(make_policy("fixed:2"), t.row, t.positions, costs)
    assert a.outcome() == b.outcome() and a.decode_ms == pytest.approx(b.decode_ms)


def test_bare_proposer_is_the_draft(lab):
    from engine.decode.step import ModelledClock
    from engine.oracles.trace import TraceProposer, TraceVerifier

    traces, _ = lab
    t = traces[1]
    at = proposals(t.positions)["draft"]
    out, n = t.row["token_ids"], len(t.row["prompt_ids"])
    run = Setting(n, MAX_NEW, "fp32", "native")
    bare = list(decode(TraceProposer(at, n), TraceVerifier(out, n), make_policy("fixed:3"), run, ModelledClock()))
    named = list(decode({"draft": TraceProposer(at, n)}, TraceVerifier(out, n), make_policy("fixed:3"), run,
                        ModelledClock()))
    assert bare == named and {r.proposer for r in bare} == {"", "draft"}


def test_costs_price_each_proposer(lab):
    _, costs = lab
    assert costs.proposers == ("draft", "ngram", "suffix")
    ng = costs.drafting("ngram")
    assert len(ng.ms) == len(ng.cold_read_ms) == len(ng.warm_read_ms) == 2 and all(x >= 0 for x in ng.ms)
    assert costs.step_ms(4, 8, "ngram") == pytest.approx(4 * ng.ms[0] + costs.verify_ms[0][4])
    assert costs.step_ms(4, 8, "ngram") == pytest.approx(costs.draft_part(4, 8, "ngram") + costs.verify_part(4, 8))
    assert costs.catchup_cost(10, 2, 8, "ngram") is not None and costs.catchup_cost(10, 2, 8, "eagle") is None
    from store import Store

    with Store(":memory:") as st:
        st.add_costs(costs.to_rows(2))
        back = CostTable.from_rows(st.costs().to_dict("records"))
    assert back.proposer_costs == costs.proposer_costs and back.step_ms(4, 40, "ngram") == costs.step_ms(4, 40, "ngram")


def test_calibration_reads_the_proposer_of_each_step():
    t = CostTable([64], [1.0], [[10.0 + k for k in range(K_MAX + 1)]], proposer_costs={"ngram": DraftCost([0.0])})
    live = [(2, 64, 2 * (12.0 + 2 * 1.0), "draft")] * 12 + [(2, 64, 2 * 12.0, "ngram")] * 12  # both twice the table
    live += [(2, 64, 99.0, "eagle")] * 30  # a proposer the table has not measured: left out
    assert calibrate(t, live).step_factor[2] == pytest.approx(2.0)
    assert calibrate(t, [(k, c, ms) for k, c, ms, _ in live[:12]]).step_factor[2] == pytest.approx(2.0)  # 3-tuples: draft


def test_a_proposer_whose_steps_run_slower_is_priced_by_its_own_steps():
    from store import Store

    t = CostTable([64], [1.0], [[10.0 + k for k in range(K_MAX + 1)]],
                  proposer_costs={"ngram": DraftCost([0.0]), "eagle": DraftCost([0.5])})
    # The draft's steps take twice the table; the n-gram's 2.4× at k = 2, 3× at k = 4 (1.5× the
    # draft's factor, in the median over its steps); the EAGLE head's too few to say.
    live = [(k, 64, 2 * t.step_ms(k, 64), "draft") for k in (0, 2, 4) for _ in range(12)]
    live += [(2, 64, 1.2 * 2 * t.step_ms(2, 64, "ngram"), "ngram")] * 6 + [(4, 64, 1.5 * 2 * t.step_ms(4, 64, "ngram"), "ngram")] * 7
    live += [(3, 64, 9 * t.step_ms(3, 64, "eagle"), "eagle")] * 11
    cal = calibrate(t, live)
    assert cal.step_factor == pytest.approx([2.0] * 9)  # the median per k, whoever drafted (k = 3: too few, k = 2 stands)
    assert set(cal.proposer_factor) == {"ngram"} and cal.proposer_factor["ngram"] == pytest.approx([3.0] * 9)
    assert cal.step_ms(4, 64, "ngram") == pytest.approx(3.0 * t.step_ms(4, 64, "ngram"))
    assert cal.step_ms(4, 64) == pytest.approx(2.0 * t.step_ms(4, 64)) and cal.step_ms(0, 64, "ngram") == cal.step_ms(0, 64)
    assert cal.step_ms(4, 64, "eagle") == pytest.approx(2.0 * t.step_ms(4, 64, "eagle"))  # the pooled factor
    # Replay charges the proposer its drafting and its own surplus on the verify: the two add up.
    assert cal.draft_part(4, 64, "ngram") + cal.verify_part(4, 64) == pytest.approx(cal.step_ms(4, 64, "ngram"))
    with Store(":memory:") as st:  # stored in the proposer's own rows
        st.add_costs(cal.to_rows(3))
        back = CostTable.from_rows(st.costs().to_dict("records"))
    assert back.proposer_factor == cal.proposer_factor and back.step_ms(4, 64, "ngram") == cal.step_ms(4, 64, "ngram")
    assert calibrate(back, live).proposer_factor == cal.proposer_factor  # from the bare forwards, not compounded


@pytest.mark.parametrize("spec, msg", [
    ("fixed:4@nope", "unknown proposer 'nope' after '@'; known: draft, eagle, ngram"),
    ("fixed:4@", "unknown proposer '' after '@'"),
    ("fixed:4@ngram:n=3", "unknown option 'n' for proposer ngram; known: max, min"),
    ("fixed:4@ngram:max=x", "proposer ngram: option max must be an integer, got 'x'"),
    ("fixed:4@ngram:max", "proposer ngram: option max needs a value"),
    ("fixed:4@ngram:max=2,max=3", "option max is given twice"),
    ("fixed:4@draft:max=2", "unknown option 'max' for proposer draft; known: vocab"),
    ("fixed:4@draft+ngram", "policy fixed drafts with one proposer, not draft\\+ngram"),
    ("fixed:4@ngram+ngram", "proposer ngram is named twice"),
    ("nope@ngram", "unknown policy 'nope@ngram'"),
])
def test_a_bad_proposer_spec_is_one_line(spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        make_policy(spec)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError):
        parse_policy(spec)  # the parser alone refuses it too (the CLI checks before loading models)


def test_a_list_of_specs_keeps_each_specs_options():
    from engine.decode.policies import split_policies

    assert split_policies("ar, fixed:2,fixed:3@ngram:max=3,min=2,rakv@draft+ngram:max=4,speckv") == [
        "ar", "fixed:2", "fixed:3@ngram:max=3,min=2", "rakv@draft+ngram:max=4", "speckv"]
    assert split_policies("fixed:4,rakv:0.5") == ["fixed:4", "rakv:0.5"]


def test_spec_parts_reach_the_policy_and_its_name():
    p = make_policy("fixed:3@ngram:max=4,min=2")
    assert (p.name, p.proposers, p.proposer_options, p.choose(None)) == (
        "fixed:3@ngram:max=4,min=2", ("ngram",), {"ngram": {"max": "4", "min": "2"}}, Action(3, proposer="ngram"))
    assert make_policy("fixed:3").proposers == ("draft",) and make_policy("fixed:3").choose(None).proposer == "draft"
    assert parse_policy("rakv@draft+ngram") == ("rakv", None) and parse_policy("fixed:2@ngram") == ("fixed", "2")


def test_unavailable_proposers_and_bad_options_fail_before_decoding(tiny_pair):
    ids = _ids(tiny_pair, "hello")
    with pytest.raises(ValueError, match="the pair has no EAGLE head") as e:
        Generation(tiny_pair, ids, make_policy("fixed:4@eagle"), GenConfig(max_new_tokens=4))
    assert "\n" not in str(e.value)
    gen = Generation(tiny_pair, ids, make_policy("fixed:4@ngram:max=3,min=4"), GenConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="min must be ≤ max"):
        gen.run()
    assert not gen.records  # refused before the prefill
