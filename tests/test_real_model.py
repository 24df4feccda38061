"""The embedded SmolLM2-135M-Instruct pair at the batch-invariant tiers (fp32, bf16): greedy
equality with HF `generate` for every policy and proposer, with prefix reuse, replay of traces,
and the CLI. Its KV tiers, KV coding and bitsandbytes tiers: test_real_model_tiers.py."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from engine.datasets.prompts import bench_prompts
from engine.decode.policies import POLICY_EXAMPLES, make_policy
from engine.lab import divergence
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.runtime.models import load_pair
from realmodel import MAX_NEW, NEAR_TIE, PROMPTS, hf_greedy, live_run, margin
from tiny import synthetic_context

# Every policy, and each proposer drafting alone (rakv and speckv choose among them all).
POLICIES = POLICY_EXAMPLES + ["fixed:4@eagle", "fixed:4@ngram", "fixed:4@suffix"]
# Reuse lives in the verifier's and each proposer's caches: every proposer, the policies that
# choose among them, and the policies that decide about reuse itself.
REUSE_POLICIES = ["ar", "fixed:4", "fixed:4@eagle", "fixed:4@ngram", "rakv", "speckv", "reuse-only", "joint:4"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def pair(request):
    return load_pair(target_tier=request.param, device="cpu")


@pytest.mark.parametrize("task,prompt", PROMPTS, ids=[t for t, _ in PROMPTS])
def test_greedy_equals_hf_generate_for_every_policy(pair, task, prompt):
    ids = encode_prompt(pair.tokenizer, prompt, chat=True)
    ref = hf_greedy(pair, ids, MAX_NEW)
    for policy in POLICIES:
        out, _ = live_run(pair, task, policy)
        i = divergence.first_difference(ref, out)
        if i is None:
            continue
        # on the row-invariant kernels exactness is arithmetic: no near tie is excused
        assert not pair.kernel_set.startswith("rowdot"), f"{pair.target_tier} {policy} {task}: differs at {i}"
        m = margin(pair, ids, ref[:i])
        assert m < NEAR_TIE, f"{pair.target_tier} {policy} {task}: differs at {i}, margin {m:.2e}"
        warnings.warn(f"near tie excused: {pair.target_tier} {policy} {task} at {i}, margin {m:.1e}")


def test_greedy_equals_hf_generate_with_a_warm_suffix_history(pair):
    """The suffix proposer reading a history that holds every prompt's own output (what a
    repeated request finds): it drafts long, and the output is still HF's."""
    from engine.oracles.suffix import SuffixHistory, prompt_key

    ids = [encode_prompt(pair.tokenizer, p, chat=True) for _, p in PROMPTS]
    refs = [hf_greedy(pair, x, MAX_NEW) for x in ids]
    history = SuffixHistory.from_outputs((prompt_key(x), r) for x, r in zip(ids, refs))
    accepted = 0
    for (task, _), x, ref in zip(PROMPTS, ids, refs):
        g = Generation(pair, x, make_policy("fixed:8@suffix"), GenConfig(max_new_tokens=MAX_NEW), history=history).run()
        i = divergence.first_difference(ref, g.token_ids)
        assert i is None or not pair.kernel_set.startswith("rowdot") and margin(pair, x, ref[:i]) < NEAR_TIE, \
            f"{pair.target_tier} {task}: differs at {i}"
        accepted += sum(r.accepted for r in g.records)
    assert accepted > len(PROMPTS) * MAX_NEW // 2  # it copied its earlier answers


def test_prefix_reuse_keeps_greedy_output_for_every_policy(pair):
    """A shared system prompt, then: a miss, an exact repeat, a partial hit (another question
    after the same system prompt), and a turn that re-sends the conversation. Output with reuse
    equals output without it, token for token, for every proposer and the policies that choose
    among them or decide about reuse (the live run's draft state is also what a trace would have:
    replay stays exact)."""
    from engine.lab.generation import encode_messages
    from engine.runtime.prefix.cache import PrefixCache

    system = {"role": "system", "content": " ".join(p for _, p in bench_prompts(1))}  # 89 tokens
    q1 = [system, {"role": "user", "content": "Write a haiku about caches."}]
    q2 = [system, {"role": "user", "content": "What is 17 times 23?"}]
    plain_first = Generation(pair, encode_messages(pair.tokenizer, q1), make_policy("ar"), GenConfig(max_new_tokens=24)).run()
    turn2 = q1 + [{"role": "assistant", "content": pair.tokenizer.decode(plain_first.token_ids, skip_special_tokens=True)},
                  {"role": "user", "content": "And one about speculation."}]
    requests = [encode_messages(pair.tokenizer, m) for m in (q1, q1, q2, turn2)]
    cfg = GenConfig(max_new_tokens=24)
    plain = [Generation(pair, ids, make_policy("ar"), GenConfig(max_new_tokens=24, reuse=False)).run().token_ids
             for ids in requests]
    for policy in REUSE_POLICIES:
        cache = PrefixCache()
        runs = [Generation(pair, ids, make_policy(policy, synthetic_context()), cfg, prefix=cache).run() for ids in requests]
        assert [r.token_ids for r in runs] == plain, (pair.target_tier, policy, [r.summary.prefix_hit for r in runs])
        assert [r.summary.prefix_hit for r in runs] == ["miss", "exact", "partial", "partial"]


def test_replay_of_traces_matches_live_runs(pair):
    """The what-if engine's promise on the real pair (fp32 and bf16): replaying a policy over the
    prompt's acceptance trace gives the live run's steps and accepted counts, one for one (the live
    runs are the greedy-identity test's, made once)."""
    from engine.lab.profiling import trace
    from engine.lab.whatif import replay

    ctx = synthetic_context()
    for task, prompt in PROMPTS[:3]:
        t = trace(pair, prompt, task, MAX_NEW)
        for spec in ("fixed:4", "speckv", "rakv"):
            live_ids, live_steps = live_run(pair, task, spec)
            rep = replay(make_policy(spec, ctx), t.row, t.positions, ctx.costs)
            assert live_ids == t.row["token_ids"], (spec, task)
            assert rep.outcome() == live_steps, (spec, task)


def test_cli_generate_json_matches_hf(tmp_path):
    task, prompt = PROMPTS[1]
    db = tmp_path / "runs.duckdb"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--prompt", prompt, "--chat", "--json",
         "--policy", "fixed:4", "--max-new-tokens", "24", "--task", task, "--db", str(db)],
        capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    pair = load_pair(target_tier="fp32", device="cpu")
    ids = encode_prompt(pair.tokenizer, prompt, chat=True)
    assert out["token_ids"] == hf_greedy(pair, ids, 24)
    for key in ("text", "tokens_per_s", "ttft_ms", "mean_accepted", "acceptance_rate", "steps"):
        assert key in out
    assert sum(s["emitted"] for s in out["steps"]) == len(out["token_ids"])

    from store import Store

    with Store(db) as st:
        assert st.run(out["run_id"])["token_ids"] == out["token_ids"]
        assert len(st.steps(out["run_id"])) == len(out["steps"])
