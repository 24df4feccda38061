from dataclasses import replace

import pytest

from engine.decode.policies import K_MAX, NEEDS_CONTEXT, POLICY_EXAMPLES, PolicyContext, make_policy
from engine.decode.policies.rakv import ALPHA0, PRIOR_TRIALS
from engine.decode.records import DecodeState, DraftToken, StepRecord
from tiny import synthetic_context


def _state(history=()):
    return DecodeState(step=1, position=1, context_len=10, remaining=50, target_tier="fp32",
                       kv_tier="native", history=list(history))


def _rec(k_chosen, k_drafted, accepted, ents=(), confs=()):
    from engine.decode.records import signal_summary as summarize

    ents, confs = list(ents) or [0.5] * k_drafted, list(confs) or [0.9] * k_drafted
    return StepRecord(step=1, position=0, k_chosen=k_chosen, k_drafted=k_drafted, accepted=accepted,
                      emitted=accepted + 1, token_ids=[0] * (accepted + 1), **summarize(ents, confs),
                      entropies=ents, confidences=confs, draft_ms=0, verify_ms=0, decide_ms=0,
                      context_len=10, target_tier="fp32", kv_tier="native")


def _costs(**kw):
    return synthetic_context(**kw).costs


def _context():
    return synthetic_context()


@pytest.mark.parametrize("spec", POLICY_EXAMPLES + ["fixed:0", "fixed:8", "threshold:0.7", "heuristic:2", "rakv:0.3"])
def test_examples_parse_and_choose_a_valid_k(spec):
    pol = make_policy(spec, _context())
    k = pol.choose(_state()).k
    assert 0 <= k <= K_MAX


@pytest.mark.parametrize("spec", NEEDS_CONTEXT)
def test_learned_and_costed_policies_say_what_they_need(spec):
    with pytest.raises(ValueError, match="python -m engine (costs|retrain)") as e:
        make_policy(spec)
    assert "\n" not in str(e.value)


def test_rakv_speculates_only_when_it_pays():
    pol = make_policy("rakv", PolicyContext(costs=_costs()))
    sure, unsure = _state(), _state()
    sure.alpha_ewma, unsure.alpha_ewma = 0.95, 0.02
    sure.alpha_trials = unsure.alpha_trials = 200.0  # well-founded estimates
    assert pol.choose(sure).k == K_MAX  # verify is nearly free per token: draft long
    assert pol.choose(unsure).k == 0  # nothing would be accepted: plain decoding is cheapest
    assert pol.choose(sure).k == K_MAX and pol.choose(unsure).k == 0  # a repeated decision (cached) too
    # One accepted probe (α = 1/1) is weak evidence: the prior α0 = 0.6 still weighs in.
    lucky = _state()
    lucky.alpha_ewma, lucky.alpha_trials = 1.0, 1.0
    gamble = make_policy("rakv", PolicyContext(costs=_costs(draft_ms=2.0, per_token=2.0)))
    sure2 = _state()
    sure2.alpha_ewma, sure2.alpha_trials = 0.97, 200.0
    assert gamble.choose(lucky).k < gamble.choose(sure2).k
    costly_draft = make_policy("rakv", PolicyContext(costs=_costs(draft_ms=30.0)))
    assert costly_draft.choose(sure).k == 0  # a draft dearer than the target never pays
    # k = 0 teaches nothing about α: after 8 plain steps in a row, one 1-token probe.
    streak = _state([_rec(0, 0, 0)] * 8)
    streak.alpha_ewma = 0.02
    assert pol.choose(streak).k == 1


def test_rakv_and_speckv_take_reuse_only_when_the_measured_prefill_pays():
    from dataclasses import replace

    from engine.decode.costs import CostTable

    base = CostTable([64, 256, 512], [1.0] * 3, [[10.0 + 0.5 * k for k in range(K_MAX + 1)]] * 3)
    cheap = replace(base, prefill_ms=[20.0, 70.0, 140.0], fill_ms=0.01)
    dear = replace(base, prefill_ms=[20.0, 70.0, 140.0], fill_ms=5.0)  # filling dearer than reading
    assert cheap.prefill_cost(300, 0) == pytest.approx(70 + 44 * 70 / 256)
    assert cheap.prefill_cost(600, 0) == pytest.approx(140 + 88 * 70 / 256)  # extrapolated
    for spec in ("rakv", "speckv"):
        ctx = synthetic_context()
        assert make_policy(spec, PolicyContext(costs=cheap, controller=ctx.controller)).take_reuse(400, 500) == 400
        assert make_policy(spec, PolicyContext(costs=dear, controller=ctx.controller)).take_reuse(400, 500) == 0
        assert make_policy(spec, PolicyContext(costs=base, controller=ctx.controller)).take_reuse(400, 500) == 400
    assert make_policy("fixed:4").take_reuse(400, 500) == 400  # the others take what is offered


def test_drafting_must_repay_the_draft_catch_up():
    from dataclasses import replace

    ctx = synthetic_context()  # plain 10 ms a token; a k = 1 step 11.5 ms
    # The draft reads 5 tokens a ms into an empty cache, 1 a ms after its cache.
    costs = replace(ctx.costs, cold_read_ms=[0.2], warm_read_ms=[1.0])
    sure = _state([_rec(4, 4, 4)] * 3)
    sure.alpha_ewma, sure.alpha_trials = 0.95, 12.0
    cases = (((0, 0), 50, True), ((200, 0), 50, True), ((20_000, 0), 50, False), ((200, 0), 2, False),
             ((0, 200), 50, True), ((0, 1000), 50, False))
    for spec in ("rakv", "speckv"):
        pol = make_policy(spec, PolicyContext(costs=costs, controller=ctx.controller))
        for unread, remaining, drafts in cases:
            pol.reset()
            st = replace(sure, draft_unread=unread, remaining=remaining)
            assert (pol.choose(st).k > 0) is drafts, (spec, unread, remaining)
    # A probe bets on the prior acceptance: after 8 plain steps it drafts only if that repays the read.
    streak = _state([_rec(0, 0, 0)] * 8)
    rakv = make_policy("rakv", PolicyContext(costs=costs))
    assert rakv.choose(replace(streak, draft_unread=(0, 8))).k == 1
    assert rakv.choose(replace(streak, draft_unread=(0, 500))).k == 0
    assert make_policy("rakv", ctx).choose(replace(streak, draft_unread=(50_000, 0))).k == 1  # reads unmeasured


def test_rakv_takes_the_measured_acceptance_as_its_prior():
    from engine.decode.policies.rakv import ALPHA0

    ctx = synthetic_context(draft_ms=3.0)  # plain 10 ms a token; a k = 1 step 13.5 ms
    assert make_policy("rakv", ctx).alpha0 == ALPHA0  # nothing measured
    measured = PolicyContext(costs=ctx.costs, alpha0=0.3)
    pol = make_policy("rakv", measured)
    assert (pol.alpha0, pol.name) == (0.3, "rakv")  # still `rakv`: the prior is the pair's, not the user's
    assert make_policy("rakv:0.8", measured).alpha0 == 0.8  # the user's word wins
    assert make_policy("rakv", PolicyContext(costs=ctx.costs, alpha0=1.0)).alpha0 < 1.0
    # A prior of 0.3 says a draft of one token yields 1.3 tokens: on these costs, plain decoding.
    fresh = _state([_rec(0, 0, 0)])
    assert pol.choose(fresh).k == 0 and make_policy("rakv", PolicyContext(costs=ctx.costs, alpha0=0.9)).choose(fresh).k > 0


def test_probes_back_off_when_they_do_not_pay():
    from dataclasses import replace

    from engine.decode.policies.payoff import PROBE_AFTER, PROBE_MAX, probe_due

    costs = _costs()  # a step drafting k costs 10 + 1.5·k ms: plain decoding, 10 ms a token
    due = lambda hist: probe_due(_state(hist), costs)  # noqa: E731
    plain, probe, spec, dud = _rec(0, 0, 0), _rec(1, 1, 0), _rec(4, 4, 3), _rec(4, 4, 0)
    assert not due([plain] * (PROBE_AFTER - 1))
    assert due([plain] * PROBE_AFTER)
    # One probe led straight back to plain decoding: the next waits twice as long, then 4×, …
    one = [plain] * PROBE_AFTER + [probe]
    assert not due(one + [plain] * (2 * PROBE_AFTER - 1))
    assert due(one + [plain] * 2 * PROBE_AFTER)
    two = one + [plain] * 2 * PROBE_AFTER + [probe]
    assert not due(two + [plain] * (4 * PROBE_AFTER - 1))
    many = ([plain] * PROBE_MAX + [probe]) * 6
    assert due(many + [plain] * PROBE_MAX)  # never waits longer than PROBE_MAX
    # A probe whose run paid (4 tokens for 16 ms after it, 40 ms plain) resets the wait …
    paid = two + [plain] * 4 * PROBE_AFTER + [probe, spec, spec]
    assert due(paid + [plain] * PROBE_AFTER)
    # … one the policy went on with but that bought nothing (drafts rejected) counts as failed.
    bought_nothing = two + [plain] * 4 * PROBE_AFTER + [probe, dud, dud]
    assert not due(bought_nothing + [plain] * (8 * PROBE_AFTER - 1))
    assert due(bought_nothing + [plain] * 8 * PROBE_AFTER)
    # So does a generation's opening run (right after the prefill, step 0) that bought nothing,
    # and an opening with plain decoding: the policy's verdict on typical signals.
    prefill = replace(plain, step=0)
    assert not due([prefill, dud, dud] + [plain] * PROBE_AFTER)
    assert due([prefill, spec, spec] + [plain] * PROBE_AFTER)
    assert not due([prefill] + [plain] * (2 * PROBE_AFTER - 1))
    assert due([prefill] + [plain] * 2 * PROBE_AFTER)
    assert not due([prefill] + [plain] * 2 * PROBE_AFTER + [probe] + [plain] * (4 * PROBE_AFTER - 1))


def test_speckv_follows_its_predictor_and_costs():
    ctx = _context()
    pol = make_policy("speckv", ctx)
    confident = _state([_rec(4, 4, 4, ents=[0.1] * 4, confs=[0.99] * 4)])
    unsure = _state([_rec(4, 4, 0, ents=[3.0] * 4, confs=[0.2] * 4)])
    assert pol.choose(confident).k > pol.choose(unsure).k
    assert pol.last_expected >= 1.0
    paper = make_policy("speckv-paper", ctx)
    assert paper.choose(unsure).k in (2, 4, 6, 8)  # the paper's grid: never plain decoding


def test_speckv_counts_the_predicted_rate_of_each_draft_length():
    """The MLP predicts accepted / k; a k-token draft then yields 1 + k·rate tokens on average."""
    import numpy as np

    from engine.decode.acceptance import Predictor
    from engine.decode.policies.learned import SpeckvPolicy

    rate = 0.5
    flat = Predictor("mlp", {"w0": np.zeros((6, 1)), "b0": np.array([rate])}, meta={"signal_defaults": [0.5, 0.9, 0.5, 0.9]})
    pol = SpeckvPolicy(flat, _costs())  # a k-step costs 10 + 1.5·k ms
    # (1 + 0.5·k) / (10 + 1.5·k) grows with k: draft the most. (Reading the rate as a per-token α
    # would count 1 + 0.5 + … + 0.5^8 ≈ 2 tokens at k = 8 and stop at k = 2.)
    assert pol.choose(_state()).k == 8
    # Averaged with the rate rakv's prior acceptance (no draft measured yet) gives at k = 8.
    assert pol.last_expected == pytest.approx(1 + 8 * (rate + _measured_rate(ALPHA0, 8)) / 2)


def _measured_rate(alpha: float, k: int) -> float:
    """accepted / k of a k-token draft at per-token acceptance α (truncated geometric)."""
    from engine.decode.acceptance import expected_tokens

    return float((expected_tokens(alpha, k) - 1) / k)


def test_speckv_weighs_the_drafts_measured_acceptance_beside_its_predictor():
    """An MLP fitted elsewhere that under-rates the draft on this text must not hold it back
    when the run measures it accepted: its rate is averaged with the measured one."""
    import numpy as np

    from engine.decode.acceptance import Predictor
    from engine.decode.policies.learned import SpeckvPolicy

    gloomy = Predictor("mlp", {"w0": np.zeros((6, 1)), "b0": np.array([0.05])}, meta={"signal_defaults": [0.5, 0.9, 0.5, 0.9]})
    pol = SpeckvPolicy(gloomy, _costs())  # a k-step costs 10 + 1.5·k ms
    assert pol.choose(_state()).k == 2  # at the prior (0.6) beside the MLP's 0.05
    accepted = replace(_state(), alpha_ewma=0.95, alpha_trials=5.0)  # this run's drafts mostly stood
    assert pol.choose(accepted).k == 4
    blended = (0.95 * 5.0 + ALPHA0 * PRIOR_TRIALS) / (5.0 + PRIOR_TRIALS)
    assert pol.last_expected == pytest.approx(1 + 4 * (0.05 + _measured_rate(blended, 4)) / 2)


def test_speckv_scales_its_predictor_by_what_this_generation_accepted():
    import numpy as np

    from engine.decode.acceptance import Predictor
    from engine.decode.policies.learned import FEEDBACK_PRIOR, SpeckvPolicy
    from engine.decode.records import AcceptanceEWMA

    rate = 0.5
    flat = Predictor("mlp", {"w0": np.zeros((6, 1)), "b0": np.array([rate])}, meta={"signal_defaults": [0.5, 0.9, 0.5, 0.9]})
    pol = SpeckvPolicy(flat, _costs())  # a k-step costs 10 + 1.5·k ms
    assert pol.choose(_state()).k == 8
    pol.observe(_rec(8, 8, 0))  # 4 tokens predicted, none accepted: the MLP's rate is scaled by 4 / 8
    k = pol.choose(_state()).k
    scaled = rate * FEEDBACK_PRIOR / (FEEDBACK_PRIOR + 8 * rate)
    assert pol.last_expected == pytest.approx(1 + k * (scaled + _measured_rate(ALPHA0, k)) / 2) and k < 8
    pol.observe(_rec(8, 8, 0))
    pol.observe(_rec(8, 8, 0))  # 12 predicted, 0 accepted: the MLP's rate 0.125
    ewma = AcceptanceEWMA()
    for _ in range(3):
        ewma.update(0, 8)
    failed = replace(_state(), alpha_ewma=ewma.alpha, alpha_trials=ewma.trials)  # … and the run measured as much
    assert pol.choose(failed).k < k
    streak = _state([_rec(0, 0, 0)] * 8)
    assert pol.choose(streak).k == 1  # a probe: no prediction behind it, so its outcome is not counted
    pol.observe(_rec(1, 1, 1))
    assert pol._feedback == [0.0, 3 * 8 * rate]  # the three drafts it chose, not the probe
    pol.reset()  # a new generation starts from the predictor alone
    assert pol.choose(_state()).k == 8


@pytest.mark.parametrize("spec,msg", [
    ("fixed:9", "0 ≤ k ≤ 8"), ("fixed:x", "expected an integer"), ("nope", "unknown policy"),
    ("threshold:2", "0 ≤ c ≤ 1"), ("ar:3", "takes no"), ("rules:1", "takes no"),
])
def test_bad_specs_fail_with_one_line(spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        make_policy(spec)
    assert "\n" not in str(e.value)


def test_ar_and_fixed():
    assert make_policy("ar").choose(_state()).k == 0
    assert make_policy("fixed:6").choose(_state()).k == 6
    assert make_policy("fixed:0").name == "ar"


def test_heuristic_is_hf_schedule():
    pol = make_policy("heuristic")
    assert pol.choose(_state()).k == 4
    pol.observe(_rec(4, 4, 4))  # fully accepted: +2
    assert pol.choose(_state()).k == 6
    pol.observe(_rec(6, 6, 2))  # a rejection: −1
    assert pol.choose(_state()).k == 5
    for _ in range(10):
        pol.observe(_rec(pol.k, pol.k, pol.k))
    assert pol.choose(_state()).k == K_MAX  # capped
    for _ in range(20):
        pol.observe(_rec(pol.k, pol.k, 0))
    assert pol.choose(_state()).k == 1  # floor of 1, as HF
    pol.observe(_rec(1, 0, 0))  # a step cut short by the budget says nothing about γ
    assert pol.k == 1
    pol.reset()
    assert pol.k == 4


def test_threshold_stops_after_an_unsure_token():
    pol = make_policy("threshold:0.5")
    assert pol.choose(_state()).k == K_MAX
    assert pol.keep_drafting(_state(), 0, DraftToken(1, 0.2, 0.9))
    assert not pol.keep_drafting(_state(), 1, DraftToken(1, 3.0, 0.3))


def test_rules_preset_uses_previous_step_signals():
    pol = make_policy("rules")
    assert pol.choose(_state()).k == 4  # nothing known yet
    unsure = _rec(4, 3, 1, ents=[0.5, 3.0, 0.2], confs=[0.9, 0.2, 0.95])
    assert pol.choose(_state([unsure])).k == 2
    sure = _rec(4, 4, 4, ents=[0.1, 0.3, 0.2, 0.5], confs=[0.99, 0.9, 0.95, 0.85])
    assert pol.choose(_state([sure])).k == 8
    middling = _rec(4, 2, 1, ents=[1.5, 1.8], confs=[0.6, 0.5])
    assert pol.choose(_state([middling])).k == 4
    ar_step = _rec(0, 0, 0)
    assert pol.choose(_state([sure, ar_step])).k == 8  # looks back past steps that drafted nothing


# -- several proposers ---------------------------------------------------------------------------
class _ProposerCosts:
    """A cost table priced per proposer: a step drafting k costs k × that proposer's ms per
    drafted token + a verify over k + 1 tokens of 10 + per_token·k ms; no catch-up or prefill
    measured. Duck-typed: the policies ask only for these."""

    source = "measured"  # not a probe: no `why` says its costs are assumed

    def __init__(self, per_token: float = 3.0, **draft_ms: float) -> None:
        self.per_token, self.draft_ms = per_token, {"draft": 1.0, "eagle": 0.5, "ngram": 0.0, **draft_ms}

    def band(self, context_len: int) -> int:
        return 0

    def step_ms(self, k: int, context_len: int, proposer: str = "draft") -> float:
        return k * self.draft_ms[proposer] + 10.0 + self.per_token * k

    def catchup_cost(self, cold: int, warm: int, context_len: int, proposer: str = "draft"):
        return None

    def prefill_cost(self, cold: int, reused: int):
        return None


def _by(proposer, k_chosen, k_drafted, accepted, **kw):
    from dataclasses import replace

    return replace(_rec(k_chosen, k_drafted, accepted, **kw), proposer=proposer if k_drafted else "")


def _multi(history=(), lookahead=None, alphas=None, proposers=("draft", "ngram")):
    """A state of a run with several proposers: the n-gram proposer sees a 4-token continuation
    unless `lookahead` says otherwise; `alphas` the engine's per-proposer EWMAs."""
    from engine.decode.records import UNBOUNDED

    st = _state(history)
    st.proposers = proposers
    st.lookahead = {"draft": UNBOUNDED, "eagle": UNBOUNDED, "ngram": 4, **(lookahead or {})}
    st.alphas = dict(alphas or {})
    return st


def _ctx(costs):
    return PolicyContext(costs=costs, controller=synthetic_context().controller)


def test_rakv_drafts_with_the_proposer_that_makes_a_token_cheapest():
    costs = _ProposerCosts()  # a drafted token costs the draft model 1 ms, the n-gram lookup nothing
    good = [_by("ngram", 4, 4, 4)] * 3
    alphas = {"ngram": (0.95, 5.0), "draft": (0.5, 5.0)}
    pol = make_policy("rakv", _ctx(costs))
    a = pol.choose(_multi(good, alphas=alphas))
    assert a.proposer == "ngram" and 1 <= a.k <= 4  # never past its continuation
    assert pol.why.startswith(f"ngram γ {a.k}: α ≈ 0.75,") and "ms/token vs 10.0 plain" in pol.why
    assert pol.choose(_multi(good, {"ngram": 2}, alphas)).k <= 2
    # No match: the n-gram proposer can propose nothing and is no candidate; the draft still pays here …
    a = pol.choose(_multi(good, {"ngram": 0}, alphas))
    assert (a.proposer, a.k) == ("draft", 1) and pol.why.startswith("draft γ 1:")
    # … and where it does not either, plain decoding, saying why.
    dear = make_policy("rakv", _ctx(_ProposerCosts(draft=30.0)))
    assert dear.choose(_multi(good, {"ngram": 0}, alphas)).k == 0
    assert dear.why.startswith("plain:") and "ngram: nothing to propose" in dear.why
    # The n-gram lookup accepted at almost nothing does not pay even for free (verify costs 3 ms a token).
    assert dear.choose(_multi(good, alphas={"ngram": (0.0, 5.0)})).k == 0
    # One proposer: the engine's own EWMA, as always (the state's per-proposer ones are not read).
    one = _multi(proposers=("draft",), alphas={"draft": (0.0, 5.0)})
    one.alpha_ewma, one.alpha_trials = 0.95, 200.0
    a = pol.choose(one)
    assert a.proposer == "draft" and a.k > 1


def test_a_cost_table_from_before_proposers_prices_the_draft_alone():
    """A stored table that prices only the draft model keeps working: the proposers it does not
    price are not weighed (the why says so), never a crash in the middle of a run."""
    old = _costs(draft_ms=30.0)  # a CostTable without other proposers' costs; the draft never pays
    good = [_by("ngram", 4, 4, 4)] * 3
    for spec in ("rakv", "speckv"):
        pol = make_policy(spec, PolicyContext(costs=old, controller=synthetic_context().controller))
        a = pol.choose(_multi(good, alphas={"ngram": (0.95, 5.0)}))
        assert a.k == 0 or a.proposer == "draft", (spec, a)
    assert make_policy("rakv", PolicyContext(costs=old)).choose(_multi(good)).k == 0
    rakv = make_policy("rakv", PolicyContext(costs=old))
    rakv.choose(_multi(good))
    assert "ngram: no costs measured" in rakv.why


def test_a_restricted_spec_never_drafts_with_another_proposer():
    from engine.decode.records import UNBOUNDED

    costs = _ProposerCosts(draft=3.0)
    histories = ([], [_by("ngram", 4, 4, 4)] * 3, [_by("draft", 2, 2, 0)] + [_rec(0, 0, 0)] * 40,
                 [_by("ngram", 1, 1, 0)] + [_rec(0, 0, 0)] * 40)
    for spec, only in (("rakv@draft", "draft"), ("rakv@ngram", "ngram"), ("speckv@draft", "draft"),
                       ("speckv@ngram", "ngram")):
        pol = make_policy(spec, _ctx(costs))
        assert pol.proposers == (only,) and pol.name == spec
        for hist in histories:
            for look in (0, 2, UNBOUNDED):
                for alpha in (0.0, 0.5, 0.99):
                    a = pol.choose(_multi(hist, {"ngram": look}, {"draft": (alpha, 5.0), "ngram": (alpha, 5.0)}))
                    assert a.k == 0 or a.proposer == only, (spec, hist, look, alpha, a)
                    if only == "ngram" and look == 0:
                        assert a.k == 0  # no match: nothing to draft with


def test_each_proposer_waits_for_its_own_probe():
    from dataclasses import replace

    from engine.decode.policies.payoff import probe_due

    costs = _ProposerCosts(draft=30.0)
    plain, dud, spec = _rec(0, 0, 0), _by("ngram", 1, 1, 0), _by("draft", 4, 4, 3)
    prefill = replace(plain, step=0)
    due = lambda hist, p: probe_due(_multi(hist), costs, p)  # noqa: E731
    # The n-gram probe right after the prefill bought nothing: its next waits 16 steps it did not
    # draft, the draft model's steps counted; the draft, drafting all along, is due for nothing.
    hist = [prefill, dud] + [spec] * 15
    assert not due(hist, "ngram") and due(hist + [spec], "ngram") and not due(hist + [spec], "draft")
    # The policy: a due probe of the free n-gram proposer replaces a plain step …
    alphas = {"ngram": (0.0, 5.0)}  # it was rejected: α ≈ 0.22, below what a verified token costs
    rakv = make_policy("rakv", _ctx(costs))
    a = rakv.choose(_multi([prefill, dud] + [plain] * 16, alphas=alphas))
    assert (a.k, a.proposer) == (1, "ngram") and rakv.why.startswith("probe ngram")
    # (A step earlier only the draft model's wait was over; at 30 ms a drafted token against a
    # 10 ms plain step no γ pays even at its prior α: a probe could only lose, so the step is plain.)
    a = rakv.choose(_multi([prefill, dud] + [plain] * 15, alphas=alphas))
    assert a.k == 0 and rakv.why.startswith("plain: a probe of draft would not pay here")
    # Where drafting would pay at its prior (1 ms a token), the draft's due probe is taken.
    paying = make_policy("rakv", _ctx(_ProposerCosts(draft=1.0)))
    a = paying.choose(_multi([prefill, dud] + [plain] * 15, alphas=alphas))
    assert (a.k, a.proposer) == (1, "draft") and paying.why.startswith("probe draft: draft has not drafted")
    assert rakv.choose(_multi([prefill, dud] + [plain] * 14, alphas=alphas)).k == 0  # neither is due
    assert rakv.choose(_multi([prefill, dud] + [plain] * 16, {"ngram": 0}, alphas)).proposer != "ngram"  # no match
    # … never a draft of another proposer that pays.
    cheap = make_policy("rakv", _ctx(_ProposerCosts(draft=0.5)))
    a = cheap.choose(_multi(hist + [spec], alphas={"ngram": (0.0, 5.0), "draft": (0.75, 5.0)}))
    assert a.proposer == "draft" and a.k > 1


def test_a_due_probe_outbids_a_proposer_that_wins_by_a_hair():
    """Where a verify's extra rows cost nothing (bf16 here), a head that is seldom right still
    wins step after step by a hair over plain decoding and over a draft that once failed; the
    draft's due probe takes the step when its one token at its prior promises more, not when
    the winner's draft pays well (rakv.choose_probe, which speckv shares)."""
    costs = _ProposerCosts(per_token=0.0)  # a step drafting k: 10 ms + 1 ms (draft) or 0.5 ms (eagle) a token
    prefill, dud = replace(_rec(0, 0, 0), step=0), _by("draft", 2, 2, 0)
    hist = [prefill, dud] + [_by("eagle", 2, 2, 0)] * 16  # the draft has not drafted for 16 steps
    pol = make_policy("rakv", _ctx(costs))
    failing = {"eagle": (0.0, 5.0), "draft": (0.0, 5.0)}  # both rejected: eagle wins at ~8 ms a token
    a = pol.choose(_multi(hist, alphas=failing, proposers=("draft", "eagle")))
    assert (a.k, a.proposer) == (1, "draft") and pol.why.startswith("probe draft")
    a = pol.choose(_multi(hist, alphas={**failing, "eagle": (0.95, 5.0)}, proposers=("draft", "eagle")))
    assert a.proposer == "eagle" and a.k > 1  # the winner's draft pays well: no probe takes its place


def test_speckv_weighs_the_other_proposers_by_their_acceptance():
    import numpy as np

    from engine.decode.acceptance import Predictor
    from engine.decode.policies.learned import SpeckvPolicy

    flat = Predictor("mlp", {"w0": np.zeros((6, 1)), "b0": np.array([0.3])}, meta={"signal_defaults": [0.5, 0.9, 0.5, 0.9]})
    pol = SpeckvPolicy(flat, _ProposerCosts(draft=3.0))  # the draft's drafts: 30% accepted, 6 ms a token
    good = [_by("ngram", 4, 4, 4, ents=[0.0] * 4, confs=[1.0] * 4)] * 3
    a = pol.choose(_multi(good, alphas={"ngram": (0.95, 5.0)}))
    assert a.proposer == "ngram" and 1 <= a.k <= 4 and pol.why.startswith(f"ngram γ {a.k}: predicted")
    # The MLP reads the draft model's own last draft, not an n-gram copy's certainty.
    unsure = _by("draft", 4, 4, 0, ents=[3.0] * 4, confs=[0.2] * 4)
    sure = _by("draft", 4, 4, 4, ents=[0.0] * 4, confs=[1.0] * 4)
    cheap = make_policy("speckv", _ctx(_ProposerCosts(per_token=0.5)))
    k = lambda hist: cheap.choose(_multi(hist, {"ngram": 0})).k  # noqa: E731
    assert k([unsure] + good) == k([unsure]) < k([sure])
    cheap.observe(_by("ngram", 4, 4, 0))  # another proposer's rejection says nothing of the MLP's rates
    assert cheap._feedback == [0.0, 0.0]


class _Lookup:
    """A toy n-gram proposer: the tokens that followed the newest earlier occurrence of the last one."""

    name, unread = "ngram", (0, 0)

    def __init__(self, prompt):
        self.context = list(prompt)

    def _match(self) -> list[int]:
        last = self.context[-1]
        for i in range(len(self.context) - 2, -1, -1):
            if self.context[i] == last:
                return self.context[i + 1 : -1][:8]
        return []

    def lookahead(self) -> int:
        return len(self._match())

    def propose(self, k, keep_drafting):
        return [DraftToken(t, 0.0, 1.0) for t in self._match()[:k]]

    def update(self, accepted, emitted):
        self.context += emitted


class _Wrong(_Lookup):
    """A toy draft model that never guesses right."""

    name = "draft"

    def lookahead(self) -> int:
        from engine.decode.records import UNBOUNDED

        return UNBOUNDED

    def propose(self, k, keep_drafting):
        return [DraftToken(-1, 2.0, 0.3) for _ in range(k)]


class _Text:
    """A toy greedy verifier over a known output: accepts the drafts' common prefix with it."""

    ended, reused = False, 0

    def __init__(self, out):
        self.out, self.pos = out, 0

    def prefill(self, take):
        return self._emit(1)[0]

    def verify(self, drafted):
        n = 0
        while n < len(drafted) and self.pos + n < len(self.out) and drafted[n].token_id == self.out[self.pos + n]:
            n += 1
        return n, self._emit(n + 1)

    def _emit(self, n):
        new = self.out[self.pos : self.pos + n]
        self.pos += len(new)
        self.ended = self.pos >= len(self.out)
        return new


def _toy_run(spec, out, prompt):
    from engine.decode.step import Setting, decode

    pol = make_policy(spec, _ctx(_ProposerCosts()))
    proposers = {"draft": _Wrong(prompt), "ngram": _Lookup(prompt)}
    if pol.proposers is not None:
        proposers = {p: proposers[p] for p in pol.proposers}
    return list(decode(proposers, _Text(out), pol, Setting(len(prompt), len(out), "fp32", "native"), lambda: 0.0))


def test_rakv_moves_to_the_proposer_that_gets_accepted_in_a_run():
    """Through the step loop: on a text that repeats itself, with a draft that never guesses right,
    rakv drafts mostly by n-gram lookup; and decides from records alone (the same run twice)."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    out = [9] + prompt * 5
    steps = _toy_run("rakv", out, prompt)
    assert [t for r in steps for t in r.token_ids] == out
    drafted = [r for r in steps if r.k_drafted]
    assert {r.proposer for r in drafted} <= {"draft", "ngram"}
    by_ngram = [r for r in drafted if r.proposer == "ngram"]
    assert len(by_ngram) > 0.8 * len(drafted) and sum(r.accepted for r in by_ngram) > 0.6 * len(out)
    assert [(r.proposer, r.k_chosen, r.accepted) for r in steps] == \
           [(r.proposer, r.k_chosen, r.accepted) for r in _toy_run("rakv", out, prompt)]
    assert all(r.proposer in ("", "draft") for r in _toy_run("rakv@draft", out, prompt))
    plain = _toy_run("rakv@ngram", out, prompt)
    assert {r.proposer for r in plain if r.k_drafted} == {"ngram"} and len(plain) < len(out) / 2


REPLAY_PROMPTS = ("ab ab ab ab ab ab", "def add(a, b): return a + b\ndef add(")


@pytest.fixture(scope="module")
def traced_proposers(tiny_pair):
    """Traces of every proposer the tiny pair has along two prompts, and costs that make the
    n-gram lookup free and a verified token dear, so that choosing between the two is a real choice."""
    from engine.decode.costs import CostTable, DraftCost
    from engine.lab.profiling import trace

    costs = CostTable([1], [1.0], [[10.0 + 3.0 * k for k in range(K_MAX + 1)]],
                      proposer_costs={"ngram": DraftCost([0.0])})
    return [trace(tiny_pair, p, "code", 24) for p in REPLAY_PROMPTS], costs


@pytest.mark.parametrize("spec", ["rakv", "speckv", "rakv@ngram", "fixed:3@ngram"])
def test_replay_matches_the_live_run_choosing_among_proposers(tiny_pair, traced_proposers, spec):
    """A trace records every proposer's proposal; a replay then takes the live run's steps, who
    drafted each included."""
    from engine.lab.generation import GenConfig, Generation, encode_prompt
    from engine.lab.whatif import replay

    traces, costs = traced_proposers
    ctx = PolicyContext(costs=costs, controller=synthetic_context().controller)
    seen = set()
    for t in traces:
        assert {r["proposer"] for r in t.positions} == {"draft", "ngram", "suffix"}
        ids = encode_prompt(tiny_pair.tokenizer, t.row["prompt"], chat=True)
        live = Generation(tiny_pair, ids, make_policy(spec, ctx), GenConfig(max_new_tokens=24)).run()
        rep = replay(make_policy(spec, ctx), t.row, t.positions, costs)
        assert live.token_ids == t.row["token_ids"]
        assert [(r.proposer, r.k_chosen, r.k_drafted, r.accepted, r.emitted) for r in rep.steps] == \
               [(r.proposer, r.k_chosen, r.k_drafted, r.accepted, r.emitted) for r in live.records]
        seen |= {r.proposer for r in live.records if r.k_drafted}
    assert "ngram" in seen  # the lookup drafted somewhere
    if spec.startswith("rakv@") or spec.startswith("fixed"):
        assert seen == {"ngram"}


@pytest.mark.parametrize("spec", ["rakv:0.95@draft", "speckv@draft"])
def test_a_proposer_that_keeps_losing_is_retired_with_a_why(spec):
    """A draft that is never right, under a policy that hopes it is (rakv with α0 0.95): its drafts'
    loss stays bounded by RETIRE_STEPS plain steps (plus the one draft that crossed it), then it is
    not tried again in the run, and the policy says why."""
    from engine.decode.policies.rakv import MIN_DRAFTS, RETIRE_STEPS
    from engine.decode.step import Setting, decode

    prompt, out = [1, 2, 3, 4], list(range(100, 300))  # nothing repeats: no n-gram match either
    pol = make_policy(spec, _ctx(_ProposerCosts()))
    steps = list(decode({"draft": _Wrong(prompt)}, _Text(out), pol, Setting(len(prompt), len(out), "fp32", "native"),
                        lambda: 0.0))
    assert [t for r in steps for t in r.token_ids] == out
    costs = pol.costs
    drafted = [r for r in steps if r.k_drafted]
    lost = [costs.step_ms(r.k_drafted, r.context_len, "draft") - r.emitted * costs.step_ms(0, r.context_len)
            for r in drafted]
    bound = RETIRE_STEPS * costs.step_ms(0, 10)
    if spec.startswith("speckv"):
        # speckv weighs the draft's measured acceptance beside its MLP: it stops drafting on its own
        # (one-token probes, each wait doubled), its loss within the bound before the ledger must act.
        assert sum(lost) <= bound and all(r.k_drafted == 1 for r in drafted) and pol.why.startswith("plain")
        return
    crossed = next(i for i in range(len(lost)) if i + 1 >= MIN_DRAFTS and sum(lost[: i + 1]) > bound)
    assert crossed == len(drafted) - 1  # the draft that crossed the bound was the last one
    assert "draft retired: its drafts lost" in pol.why
