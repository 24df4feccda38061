"""The llama.cpp target engine (engine/runtime/llamacpp.py, engine/oracles/llama_target.py) on the
embedded GGUF as shipped (Q4_1): its plain decoding is llama.cpp's own, speculation runs over it
with every proposer and policy, its runs store and replay, and bad input gets one line."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.decode.policies import make_policy
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.runtime import llamacpp
from tiny import synthetic_context

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("Write a Python function that checks whether a number is prime.",
           "Summarize in one sentence: the cat sat on the mat all day, watching the birds outside.")
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair():
    from engine.runtime.models import load_pair

    return load_pair(None, None, None, engine="llamacpp")


@pytest.fixture(scope="module")
def stock(pair):
    """llama-cpp-python's own Llama on the same file and settings."""
    m = pair.target
    return llamacpp.stock_llama(m.path, m.threads, m.extra_bufts)


def _llama_greedy(llm, ids: list[int], n: int, eog) -> list[int]:
    llm.reset()
    out = []
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(int(tok))
        if tok in eog or len(out) >= n:
            break
    return out


def _run(pair, prompt: str, policy: str, **cfg) -> Generation:
    ids = encode_prompt(pair.tokenizer, prompt, chat=True)
    return Generation(pair, ids, make_policy(policy, synthetic_context()), GenConfig(max_new_tokens=MAX_NEW, **cfg)).run()


def test_the_pair_names_its_engine_format_and_kernels(pair):
    assert pair.engine == "llamacpp" and pair.target_tier == "q4_1"
    assert pair.kernel_set.startswith("llamacpp-0.3.36")
    assert pair.vocab_size == pair.target.n_vocab == 49152
    assert pair.max_context == pair.target.n_ctx and pair.eos_ids


def test_ar_is_llama_cpps_own_one_token_decoding(pair, stock):
    for prompt in PROMPTS:
        ids = encode_prompt(pair.tokenizer, prompt, chat=True)
        g = _run(pair, prompt, "ar")
        assert g.token_ids == _llama_greedy(stock, ids, MAX_NEW, pair.eos_ids), prompt
        assert all(r.k_drafted == 0 and r.emitted == 1 for r in g.records[1:])


@pytest.mark.parametrize("policy", ["fixed:4@draft", "fixed:3@ngram", "fixed:3@suffix", "rakv", "heuristic", "speckv"])
def test_every_proposer_and_policy_runs_on_it(pair, policy):
    g = _run(pair, PROMPTS[0], policy)
    s = g.summary
    assert s.n_tokens == len(g.token_ids) == sum(r.emitted for r in g.records)
    assert s.stop_reason in ("eos", "max_new_tokens") and (s.stop_reason == "eos" or s.n_tokens == MAX_NEW)
    for r in g.records[1:]:
        assert 0 <= r.accepted <= r.k_drafted and 1 <= r.emitted <= r.accepted + 1
    if policy.startswith("fixed:4@draft"):
        assert s.n_steps < s.n_tokens  # the draft's tokens were accepted somewhere


def test_the_verify_drops_what_it_rejected(pair):
    from engine.decode.records import DraftToken
    from engine.oracles import target_verifier
    from engine.oracles.sampling import Sampler

    ids = encode_prompt(pair.tokenizer, PROMPTS[1], chat=True)
    v = target_verifier(pair, ids, Sampler(0.0, 1.0, None, pair.device))
    first = v.prefill()
    n, emitted = v.verify([DraftToken(t, 0.0, 0.0) for t in (7, 8, 9)])  # almost surely wrong
    assert v.ctx.held == v.tokens[:-1] and v.tokens == ids + [first] + emitted
    assert n == 0 and len(emitted) == 1
    plain_next = v.verify([])[1]
    v.rewind(len(ids) + 2)  # back to before that step: the same step gives the same token
    assert v.verify([])[1] == plain_next and len(v.ctx.held) == len(v.tokens) - 1


def test_a_sampling_run_reproduces_from_its_seed(pair):
    a = _run(pair, PROMPTS[1], "fixed:3@draft", temperature=0.8, seed=11)
    b = _run(pair, PROMPTS[1], "fixed:3@draft", temperature=0.8, seed=11)
    assert a.token_ids == b.token_ids


def test_runs_in_turns_make_what_each_makes_alone(pair):
    """Sessions' decodes advance a step each in turn (engine/lab/decode_lock.stepped): each verifier
    leases a llama.cpp context of its own, so two runs interleaved step by step make exactly
    what each makes alone."""
    specs = [(PROMPTS[0], "fixed:3@draft", {}), (PROMPTS[1], "fixed:3@suffix", {"temperature": 0.8, "seed": 5})]
    alone = [_run(pair, p, spec, **cfg).token_ids for p, spec, cfg in specs]
    live = {i: iter(Generation(pair, encode_prompt(pair.tokenizer, p, chat=True), make_policy(spec, synthetic_context()),
                               GenConfig(max_new_tokens=MAX_NEW, **cfg))) for i, (p, spec, cfg) in enumerate(specs)}
    made: list[list[int]] = [[] for _ in specs]
    while live:
        for i, g in list(live.items()):  # a step each, in turn
            if (rec := next(g, None)) is None:
                del live[i]
            else:
                made[i].extend(rec.token_ids)
    assert made == alone


def test_kv_tiers_are_llama_cpps_cache_types(pair):
    g = _run(pair, PROMPTS[0], "fixed:3@draft", kv_tier="q8_0")
    assert g.kv_bytes_per_token == llamacpp.LlamaModel.kv_bytes_per_token(pair.target, "q8_0")
    assert g.kv_bytes_per_token < _run(pair, PROMPTS[0], "ar").kv_bytes_per_token
    with pytest.raises(ValueError, match="unknown KV tier 'fp8' on the llama.cpp engine; known: native, q8_0, q4_0"):
        _run(pair, PROMPTS[0], "ar", kv_tier="fp8")


def test_its_runs_store_the_engine_and_replay(pair):
    from engine.lab.profiling import trace
    from engine.lab.whatif import replay
    from engine.service.generation import Request, keep, open_generation
    from store import Store

    with Store(":memory:") as st:
        gen = open_generation(pair, Request(PROMPTS[0], "fixed:2@ngram", max_new_tokens=MAX_NEW), context=None)
        gen.run()
        kept = keep(gen, Request(PROMPTS[0], "fixed:2@ngram", max_new_tokens=MAX_NEW), st)
        row = st.runs().set_index("run_id").loc[kept.run_id]
        assert row["engine"] == "llamacpp" and row["target_tier"] == "q4_1" and "llamacpp" in row["device"]
        t = trace(pair, PROMPTS[1], "summarization", max_new_tokens=MAX_NEW)
        ar = _run(pair, PROMPTS[1], "ar")
        assert t.row["token_ids"] == ar.token_ids  # a trace is the engine's plain decoding
        r = replay(make_policy("fixed:3@draft"), t.row, t.positions)
        assert [x for step in r.steps for x in step.token_ids] == ar.token_ids
        live = _run(pair, PROMPTS[1], "fixed:3@draft")
        if live.token_ids == ar.token_ids:  # where the batched verify kept llama.cpp's plain output
            shape = lambda recs: [(x.k_drafted, x.accepted, x.emitted) for x in recs]  # noqa: E731
            assert shape(r.steps) == shape(live.records)


def test_costs_are_measured_on_this_engine(pair):
    from engine.decode.costs import CostTable
    from engine.lab.profiling import measure_costs

    table = measure_costs(pair, (64,), reps=2)
    v = table.verify_ms[0]
    assert len(v) == 9 and all(b >= a for a, b in zip(v, v[1:])) and v[0] > 0
    assert table.fill_ms is None and "llamacpp" in table.key["device"]
    assert CostTable.from_rows(table.to_rows(2)).verify_ms == table.verify_ms  # it stores and reads back


# -- bad input: one line each, nothing loaded ----------------------------------------------------
def _write_gguf(path: Path, arch: str) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_that_is_not_llama_family_is_refused(tmp_path):
    from engine.runtime.models import load_pair

    path = _write_gguf(tmp_path / "other.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"other.gguf is a 'gpt2' model; the llama.cpp engine reads llama-family"):
        load_pair(str(path), None, "q4_1", engine="llamacpp")


def test_a_truncated_gguf_is_refused(tmp_path):
    from engine.base.names import EMBEDDED_GGUF
    from engine.runtime.embedded import gguf_dir

    src = gguf_dir() / EMBEDDED_GGUF
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(src.stat().st_size // 2))
    with pytest.raises(ValueError, match=r"cut.gguf is truncated|cut.gguf is not a readable GGUF"):
        llamacpp.check_llama_family(cut)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="junk.gguf is not a readable GGUF"):
        llamacpp.check_llama_family(tmp_path / "junk.gguf")


def test_a_draft_whose_vocabulary_differs_is_refused(tiny_dirs):
    from engine.runtime.models import load_pair

    with pytest.raises(ValueError, match="different vocabulary from the target"):
        load_pair(None, str(tiny_dirs[1]), "q4_1", engine="llamacpp")


def test_unknown_engine_format_or_device_is_one_line():
    from engine.runtime.models import load_pair

    with pytest.raises(ValueError, match="unknown engine 'vulkan'; known: torch, llamacpp"):
        load_pair(engine="vulkan")
    with pytest.raises(ValueError, match="unknown llama.cpp weight format 'int4'; known: q4_1, q8_0, bf16, f32"):
        load_pair(None, None, "int4", engine="llamacpp")
    with pytest.raises(ValueError, match="runs on the CPU here"):
        load_pair(None, None, "q4_1", device="cuda", engine="llamacpp")


def test_a_crashing_setting_is_probed_in_a_child_and_avoided(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    shutil.copy(_write_gguf(tmp_path / "x.gguf", "llama"), src)
    calls = []

    def child(what, path, extra, threads, **kw):  # the repacked kernels crash, the plain ones run
        calls.append(extra)
        if extra == "1":
            raise ValueError(f"llama.cpp probe {llamacpp._how_it_ended(-4)}: no message")
        return "ok"

    monkeypatch.setattr(llamacpp, "_child", child)
    p = llamacpp.probe(src, 1, tmp_path)
    assert p.extra_bufts is False and "crashed (SIGILL)" in p.tried[0] and calls == ["1", "0"]
    assert llamacpp.probe(src, 1, tmp_path) == p and calls == ["1", "0"]  # cached: no child again
    monkeypatch.setattr(llamacpp, "_child", lambda *a, **k: (_ for _ in ()).throw(ValueError("crashed (SIGSEGV)")))
    (bad := tmp_path / "n.gguf").write_bytes(src.read_bytes())
    with pytest.raises(ValueError, match=r"llama.cpp cannot run n.gguf on this CPU: repacked kernels on: crashed"):
        llamacpp.probe(bad, 1, tmp_path)
    with pytest.raises(ValueError, match="cannot run n.gguf"):  # the verdict is cached too
        llamacpp.probe(bad, 1, tmp_path)


def test_a_real_child_crash_is_one_line(tmp_path):
    """The child's signal, not a traceback: a model file llama.cpp cannot load ends the child only."""
    path = _write_gguf(tmp_path / "empty.gguf", "llama")
    with pytest.raises(ValueError, match=r"^llama.cpp probe (crashed|failed)"):
        llamacpp._child("probe", str(path), "0", "1")


def test_the_cli_generates_on_llama_cpp():
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--engine", "llamacpp", "--prompt", PROMPTS[0],
                        "--chat", "--policy", "fixed:3@ngram", "--max-new-tokens", "8", "--json", "--db", ""],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target_tier"] == "q4_1" and out["n_tokens"] == 8 and "llamacpp" in out["device"]
    bad = subprocess.run([sys.executable, "-m", "engine", "generate", "--engine", "llamacpp", "--prompt", "x",
                          "--kv-tier", "int8", "--db", ""], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "on the llama.cpp engine" in bad.stderr


def test_the_live_page_runs_on_llama_cpp_and_stores_the_engine(tmp_path, monkeypatch):
    from apptest import _app, _errors, press_generate
    from store import Store

    db = tmp_path / "ui.duckdb"
    for name, value in (("SPECLAB_TARGET", ""), ("SPECLAB_DRAFT", ""), ("SPECLAB_DB", str(db)),
                        ("SPECLAB_ENGINE", "llamacpp")):
        monkeypatch.setenv(name, value)
    at = _app()
    assert at.sidebar.selectbox(key="speclab_engine").value == "llamacpp"
    assert at.selectbox(key="live_tier_llamacpp").options == ["q4_1", "q8_0", "bf16", "f32"]
    at.selectbox(key="live_kv_tier_llamacpp").set_value("q8_0")
    at.selectbox(key="live_policy").set_value("fixed:4")
    at.number_input(key="live_max_new").set_value(12)
    press_generate(at, timeout=300)
    assert not at.exception and not _errors(at), _errors(at)
    saved = [s.value for s in at.success]
    assert len(saved) == 1 and saved[0].startswith("Stored as run "), saved
    with Store(str(db)) as st:
        run = st.run(saved[0].split()[3])
    assert run["engine"] == "llamacpp" and run["target_tier"] == "q4_1" and run["kv_tier"] == "q8_0"
    assert 1 <= run["n_tokens"] <= 12


# -- the llama.cpp export ------------------------------------------------------------------------
def test_the_llamacpp_export_loads_and_runs_in_llama_cpp(pair, stock, tmp_path):
    """The draft GGUF loads in llama.cpp, agrees with the target as SpecLab's draft does (a wrong
    tensor layout would agree almost never), and drives llama.cpp's speculative path."""
    import numpy as np

    from engine.service.export.llamacpp import pinned_flags, write_llamacpp_export
    from engine.service.export.tuned_config import TunedConfig

    manifest = write_llamacpp_export(TunedConfig(engine="llamacpp", policy="fixed:3@draft"), tmp_path / "x", "test")
    args = manifest["server_args"]
    assert args[args.index("--spec-draft-n-max") + 1] == "3" and args[args.index("--spec-draft-model") + 1] == "draft.gguf"
    assert set(a for a in args if a.startswith("-")) <= set(pinned_flags()["flags"])
    m = pair.target
    draft = llamacpp.GgufDraft(tmp_path / "x" / "draft.gguf", m.threads, tmp_path, 3)
    ids = encode_prompt(pair.tokenizer, PROMPTS[0], chat=True)
    out = _llama_greedy(stock, ids, 16, pair.eos_ids)
    agree = [int(draft(np.array(ids + out[:i]))[0] == out[i]) for i in range(12)]
    assert sum(agree) >= 6, agree
    spec = llamacpp.stock_llama(m.path, m.threads, m.extra_bufts, draft_model=draft)
    assert len(_llama_greedy(spec, ids, 16, pair.eos_ids)) == 16


def test_llamacpp_export_flags_are_the_pinned_builds():
    from engine.service.export.formats import render
    from engine.service.export.llamacpp import check_flags
    from engine.service.export.tuned_config import TunedConfig

    text = json.loads(render(TunedConfig(engine="llamacpp", policy="fixed:4@ngram:max=2"), "llamacpp"))
    assert text["settings"] == {"type": "ngram-simple", "size_n": 2, "size_m": 4, "min_hits": 1}
    assert "--spec-ngram-simple-size-m" in text["server_args"] and text["draft"] is None
    with pytest.raises(ValueError, match="--draft-max was removed in llama-cpp-python 0.3.36"):
        check_flags(["--draft-max", "4"])
    with pytest.raises(ValueError, match="no counterpart of SpecLab's suffix proposer"):
        render(TunedConfig(engine="llamacpp", policy="fixed:4@suffix"), "llamacpp")
    with pytest.raises(ValueError, match="unknown tier 'fp32' on llama.cpp; known: q4_1, q8_0, bf16, f32"):
        TunedConfig(engine="llamacpp", target_tier="fp32")
    with pytest.raises(ValueError, match="tuned on the llama.cpp engine; this one runs on torch at fp32: add --engine llamacpp"):
        render(TunedConfig(policy="fixed:3@draft"), "llamacpp")


def test_tiers_and_configs_follow_the_engine():
    from engine.service.export.tuned_config import TunedConfig, from_run
    from engine.service.sweeps.serial import parse_kv_tiers, parse_tiers

    assert parse_tiers(None) == ["fp32"] and parse_tiers(None, "llamacpp") == ["q4_1"]
    assert parse_tiers("f32,q8_0", "llamacpp") == ["f32", "q8_0"] and parse_tiers("q4_1,fp32", None) == ["q4_1", "fp32"]
    with pytest.raises(ValueError, match="unknown tier.s. q4_1; known: fp32"):
        parse_tiers("q4_1")
    assert parse_kv_tiers("q4_0", "llamacpp") == ["q4_0"]
    cfg = from_run({"engine": "llamacpp", "target_tier": "f32", "kv_tier": "q8_0", "policy": "fixed:3"}, None, None)
    assert (cfg.engine, cfg.target_tier, cfg.kv_tier) == ("llamacpp", "f32", "q8_0")
    assert TunedConfig(engine="llamacpp").target_tier == "q4_1" and TunedConfig().target_tier == "fp32"
    old = from_run({"target_tier": "bf16", "policy": "fixed:3"}, None, None)  # a run from before engines
    assert (old.engine, old.target_tier) == ("torch", "bf16")


def test_the_export_and_profile_pages_follow_the_engine(tmp_path, monkeypatch):
    """On the llama.cpp engine the Export page renders llama-server's arguments and writes the draft
    GGUF; the Profile page offers its formats and KV types, and its sweep runs on llama.cpp."""
    from apptest import _app, _errors
    from engine.service.sweeps.jobs import RUNNER
    from store import Store

    db = tmp_path / "ui.duckdb"
    for name, value in (("SPECLAB_TARGET", ""), ("SPECLAB_DRAFT", ""), ("SPECLAB_DB", str(db)),
                        ("SPECLAB_ENGINE", "llamacpp")):
        monkeypatch.setenv(name, value)
    at = _app().switch_page("views/export.py").run()
    at.text_input(key="export_policy").set_value("fixed:2").run()
    assert not at.exception and not _errors(at), _errors(at)
    shown = json.loads(at.code[-1].value)
    args = shown["server_args"]
    assert shown["target_format"] == "q4_1" and args[args.index("--spec-draft-n-max") + 1] == "2"
    at.selectbox(key="export_dir_format").set_value("llamacpp")
    at.text_input(key="export_dir").set_value(str(tmp_path / "out")).run()
    at.button(key="export_dir_write").click().run(timeout=300)
    assert not at.exception and not _errors(at), _errors(at)
    assert at.success[0].value.startswith(f"{tmp_path / 'out'}: llama.cpp") and (tmp_path / "out" / "draft.gguf").is_file()

    RUNNER.wait(300)
    at.switch_page("views/profile.py").run()
    assert at.multiselect(key="profile_tiers_llamacpp").options == ["q4_1", "q8_0", "bf16", "f32"]
    assert at.multiselect(key="profile_tiers_llamacpp").value == ["q4_1"]
    assert at.multiselect(key="profile_kv_tiers_llamacpp").options == ["native", "q8_0", "q4_0"]
    at.text_input(key="profile_name").set_value("ui-llama")
    at.multiselect(key="profile_policies").set_value(["ar"])
    at.number_input(key="profile_max_new").set_value(8)
    at.checkbox(key="profile_trace").set_value(False)
    at.button(key="profile_start").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    end = RUNNER.wait(300)
    assert end.state == "finished", end.error
    with Store(str(db), read_only=True) as s:
        runs = s.runs(sweep="ui-llama")
    assert len(runs) == 4 and set(runs["engine"]) == {"llamacpp"} and set(runs["target_tier"]) == {"q4_1"}


def test_the_cli_export_for_llama_cpp_is_stored_too(tmp_path):
    from store import Store

    db = tmp_path / "x.duckdb"
    r = subprocess.run([sys.executable, "-m", "engine", "export", "--engine", "llamacpp", "--format", "llamacpp",
                        "--policy", "fixed:4@ngram", "--out", str(tmp_path / "exp"), "--db", str(db)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{tmp_path / 'exp'}: llama.cpp") and "--spec-type ngram-simple" in r.stdout
    with Store(str(db), read_only=True) as st:
        stored = st.exports()
    assert list(stored["format"]) == ["llamacpp"]
    assert json.loads(stored["content"][0])["settings"]["size_m"] == 4
