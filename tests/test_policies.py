import pytest

from engine.policies import K_MAX, NEEDS_CONTEXT, POLICY_EXAMPLES, PolicyContext, make_policy
from tiny import synthetic_context
from engine.records import DecodeState, DraftToken, StepRecord


def _state(history=()):
    return DecodeState(step=1, position=1, context_len=10, remaining=50, target_tier="fp32",
                       kv_tier="native", history=list(history))


def _rec(k_chosen, k_drafted, accepted, ents=(), confs=()):
    from engine.records import signal_summary as summarize

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

    from engine.costs import CostTable

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
    from engine.policies.rakv import ALPHA0

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

    from engine.policies.base import PROBE_AFTER, PROBE_MAX, probe_due

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

    from engine.predictor import Predictor
    from engine.policies.speckv import SpeckvPolicy

    rate = 0.5
    flat = Predictor("mlp", {"w0": np.zeros((6, 1)), "b0": np.array([rate])}, meta={"signal_defaults": [0.5, 0.9, 0.5, 0.9]})
    pol = SpeckvPolicy(flat, _costs())  # a k-step costs 10 + 1.5·k ms
    # (1 + 0.5·k) / (10 + 1.5·k) grows with k: draft the most. (Reading the rate as a per-token α
    # would count 1 + 0.5 + … + 0.5^8 ≈ 2 tokens at k = 8 and stop at k = 2.)
    assert pol.choose(_state()).k == 8
    assert pol.last_expected == pytest.approx(1 + 8 * rate)


def test_speckv_scales_its_predictor_by_what_this_generation_accepted():
    import numpy as np

    from engine.predictor import Predictor
    from engine.policies.speckv import FEEDBACK_PRIOR, SpeckvPolicy

    rate = 0.5
    flat = Predictor("mlp", {"w0": np.zeros((6, 1)), "b0": np.array([rate])}, meta={"signal_defaults": [0.5, 0.9, 0.5, 0.9]})
    pol = SpeckvPolicy(flat, _costs())  # a k-step costs 10 + 1.5·k ms
    assert pol.choose(_state()).k == 8
    pol.observe(_rec(8, 8, 0))  # 4 tokens predicted, none accepted: the rate is scaled by 4 / 8
    assert pol.choose(_state()).k == 8
    assert pol.last_expected == pytest.approx(1 + 8 * rate * FEEDBACK_PRIOR / (FEEDBACK_PRIOR + 8 * rate))
    pol.observe(_rec(8, 8, 0))
    pol.observe(_rec(8, 8, 0))  # 12 predicted, 0 accepted: rate 0.125, (1 + k/8) / (10 + 1.5·k) peaks at k = 0
    assert pol.choose(_state()).k == 0
    streak = _state([_rec(0, 0, 0)] * 8)
    assert pol.choose(streak).k == 1  # a probe: no prediction behind it, so its outcome is not counted
    pol.observe(_rec(1, 1, 1))
    assert pol.choose(_state()).k == 0
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
