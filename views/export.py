"""Export: the tuned configuration as SpecLab JSON/YAML (`generate --config` reads it back), as
Hugging Face `generate` kwargs and as a vLLM `speculative_config`; saved in the store with a
version, or written as a self-contained directory (the config beside the draft as a model the
engine loads); per engine, whether this setting's export was last run there and what it gave.
Glue only: engine/service/export/ (formats.py, model_dir.py) makes every form, engine/service/ stores them."""
from __future__ import annotations

import json

import streamlit as st

from engine.base.helpers import one_line
from engine.base.names import WEIGHT_TIERS, tiers_of
from engine.service import latest_live_run, save_export, stored_exports
from engine.service.export.formats import describe_check, export_bundle, export_checks, render, vllm_fields
from engine.service.export.llamacpp import llamacpp_summary, write_llamacpp_export
from engine.service.export.model_dir import summary, write_export_dir
from engine.service.export.tuned_config import TunedConfig, default_name, from_run, to_json, to_yaml
from views.common import engine_key, settings, show_error

PREFILL_KEY = "export_prefill"
DEFAULT_TIER = "default"  # the draft tier's "loader's default" choice
FORMAT_LABELS = {"json": "SpecLab JSON", "yaml": "SpecLab YAML", "hf": "HF generate kwargs",
                 "vllm": "vLLM speculative_config", "llamacpp": "llama.cpp (llama-server)", "tree": "Token tree"}


def formats_of(cfg: TunedConfig) -> list[str]:
    """The export formats offered for `cfg`: llama.cpp's for a setting tuned on that engine (its γ
    was chosen on llama.cpp's costs; a torch engine's would not carry over), the static token tree
    for a tree policy."""
    return [f for f in FORMAT_LABELS if (f != "llamacpp" or cfg.engine == "llamacpp")
            and (f != "tree" or cfg.policy_name == "tree")]


def _prefill(db: str, target: str | None, draft: str | None, engine: str) -> TunedConfig:
    """The newest live run's settings (what was last tuned by hand), else the defaults on the
    sidebar's engine; read once per session so that the form does not jump while it is being edited."""
    if PREFILL_KEY not in st.session_state:
        try:
            run = latest_live_run(db)
        except Exception as e:  # noqa: BLE001 - an unreadable store still leaves the defaults
            show_error(e)
            run = None
        base = from_run(run, target, draft) if run else TunedConfig(target=target or "embedded", draft=draft, engine=engine)
        st.session_state[PREFILL_KEY] = base
    return st.session_state[PREFILL_KEY]


def _form(base: TunedConfig, target: str | None, draft: str | None) -> TunedConfig:
    """The widgets; raises the config's one-line ValueError for a bad combination."""
    st.caption(f"Target **{target or 'embedded'}**, draft **{draft or 'default draft'}** (from the sidebar)."
               + (f" Prefilled from {base.source}." if base.source else " Prefilled with the defaults."))
    c1, c2, c3, c4 = st.columns(4)
    policy = c1.text_input("Policy", value=base.policy, key="export_policy",
                           help="fixed:4, heuristic, threshold:0.4, rules, speckv, speckv-rf, rakv, ar, …")
    tiers_here, kv_here = tiers_of(base.engine)  # the run's engine: llama.cpp's are GGUF formats, cache types
    target_tier = c2.selectbox("Target tier", tiers_here, index=tiers_here.index(base.target_tier),
                               key=engine_key("export_target_tier", base.engine))
    tiers = (DEFAULT_TIER,) + WEIGHT_TIERS
    draft_tier = c3.selectbox("Draft tier", tiers, index=tiers.index(base.draft_tier or DEFAULT_TIER),
                              key="export_draft_tier")
    kv_tier = c4.selectbox("KV tier", kv_here, index=kv_here.index(base.kv_tier), key=engine_key("export_kv_tier", base.engine))
    c1, c2, c3, c4 = st.columns(4)
    gamma_min = c1.number_input("γ min", min_value=0, max_value=8, step=1, value=None, key="export_gamma_min",
                                placeholder=f"{base.gamma_min} (from the policy)")
    gamma_max = c2.number_input("γ max", min_value=0, max_value=8, step=1, value=None, key="export_gamma_max",
                                placeholder=f"{base.gamma_max} (from the policy)")
    version = c3.number_input("Controller version", min_value=1, step=1, value=base.controller_version,
                              key="export_controller_version", placeholder="active",
                              help="speckv*: the stored controller to pin; empty = whichever is active")
    window = c4.number_input("KV window W", min_value=1, step=1, value=base.kv_window, key="export_kv_window",
                             placeholder="no offload")
    c1, c2, c3, c4 = st.columns(4)
    max_new = c1.number_input("Max new tokens", min_value=1, step=1, value=base.max_new_tokens,
                              key="export_max_new")
    temperature = c2.number_input("Temperature", min_value=0.0, step=0.1, value=float(base.temperature),
                                  key="export_temperature")
    top_p = c3.number_input("Top-p", min_value=0.01, max_value=1.0, step=0.05, value=float(base.top_p),
                            key="export_top_p")
    budget = c4.number_input("Prefix budget MiB", min_value=1.0, step=64.0, value=float(base.prefix_budget_mib),
                             key="export_prefix_budget")
    c1, c2, _ = st.columns([1, 1, 2])
    reuse = c1.checkbox("Prefix reuse", value=base.reuse, key="export_reuse")
    coded = c2.checkbox("Code KV windows", value=base.kv_coded, key="export_kv_coded")
    return TunedConfig(
        target=target or "embedded", draft=draft, target_tier=target_tier, engine=base.engine,
        draft_tier=None if draft_tier == DEFAULT_TIER else draft_tier, kv_tier=kv_tier, policy=policy.strip(),
        controller_version=None if version is None else int(version),
        gamma_min=None if gamma_min is None else int(gamma_min), gamma_max=None if gamma_max is None else int(gamma_max),
        kv_window=None if window is None else int(window), kv_coded=coded, reuse=reuse, prefix_budget_mib=float(budget),
        max_new_tokens=int(max_new), temperature=float(temperature), top_p=float(top_p), seed=base.seed,
        source=base.source,
    )


def _show(cfg: TunedConfig, db: str) -> None:
    bundle = export_bundle(cfg)
    stem = default_name(cfg).replace("/", "_").replace(":", "-")
    texts = {"json": to_json(cfg), "yaml": to_yaml(cfg), "hf": json.dumps(bundle["hf_generate_kwargs"], indent=2),
             "vllm": None if bundle["vllm_speculative_config"] is None
             else json.dumps(bundle["vllm_speculative_config"], indent=2)}
    if "llamacpp" in formats_of(cfg):
        try:
            texts["llamacpp"] = render(cfg, "llamacpp")
        except ValueError as e:  # a proposer llama.cpp has no counterpart of: said, not raised
            texts["llamacpp"] = ValueError(one_line(e))
    if "tree" in formats_of(cfg):
        texts["tree"] = render(cfg, "tree", db)
    for tab, (fmt, text) in zip(st.tabs([FORMAT_LABELS[f] for f in texts]), texts.items()):
        with tab:
            if text is None:
                st.info(f"Policy {cfg.policy} never drafts: vLLM runs it without a speculative_config.")
                continue
            if isinstance(text, ValueError):
                st.info(str(text))
                continue
            st.code(text, language="yaml" if fmt == "yaml" else "json")
            if fmt == "hf":
                st.caption("`assistant_model` holds the draft's path: load it and pass the model. "
                           "\"Write directory\" below writes it as a standalone model whose generation_config "
                           "carries the assistant keys (where transformers reads them).")
            if fmt == "vllm":
                f = vllm_fields()
                st.caption(f"Field names of SpeculativeConfig at vLLM {f['release']} ({f['source']}).")
            if fmt == "tree":
                st.caption("The tree as engines with a fixed tree read it: rank paths (0: a node's most likely child), "
                           "best first by the acceptance per rank its stored runs measured (`from`), and which engine "
                           "reads which field (`read_by`).")
            if fmt == "llamacpp":
                st.caption("llama-server's arguments, each checked against the pinned build's flags. "
                           "\"Write directory\" below also writes the draft as a GGUF (draft.gguf) that llama.cpp "
                           "loads as its draft model.")
            ext = "yaml" if fmt == "yaml" else "json"
            name = f"{stem}.{ext}" if fmt in ("json", "yaml") else f"{stem}.{fmt}.json"
            st.download_button(f"Download {FORMAT_LABELS[fmt]}", text, file_name=name,
                               mime="application/json" if ext == "json" else "application/yaml",
                               key=f"export_download_{fmt}")
    for note in bundle["notes"]:
        st.caption(f"· {note}")


def _save(cfg: TunedConfig, db: str) -> None:
    c1, c2, c3 = st.columns([2, 1, 1])
    name = c1.text_input("Name", value="", placeholder=default_name(cfg), key="export_name")
    fmt = c2.selectbox("Format", formats_of(cfg), format_func=FORMAT_LABELS.get, key="export_format")
    c3.write("")
    if c3.button("Save to store", key="export_save"):
        try:
            name, version, _ = save_export(db, cfg, fmt, name)
            st.success(f"saved as {name} v{version}")
        except Exception as e:  # noqa: BLE001 - one line, never a traceback
            show_error(e)


def _directory(cfg: TunedConfig) -> None:
    """A self-contained export directory of the format chosen, written where the user says."""
    c1, c2, c3 = st.columns([2, 1, 1])
    path = c1.text_input("Directory", value="", placeholder="exports/my-setting (new or empty)", key="export_dir")
    fmt = c2.selectbox("Engine", formats_of(cfg), format_func=FORMAT_LABELS.get, key="export_dir_format")
    c3.write("")
    if c3.button("Write directory", key="export_dir_write", disabled=not path.strip()):
        try:
            made_by = "the workbench's Export page"
            with st.spinner("writing the draft as a standalone model…"):
                if fmt == "llamacpp":
                    line = llamacpp_summary(path.strip(), write_llamacpp_export(cfg, path.strip(), made_by))
                else:
                    line = summary(path.strip(), write_export_dir(cfg, fmt, path.strip(), made_by=made_by))
            st.success(line)
        except Exception as e:  # noqa: BLE001 - one line, never a traceback
            show_error(e)


def _engine_runs(cfg: TunedConfig, db: str) -> None:
    """Per engine: was this setting's export last run there, and what did it give."""
    st.subheader("Run in the engines")
    try:
        checks = export_checks(db, cfg)
    except Exception as e:  # noqa: BLE001
        show_error(e)
        return
    for engine, check in checks.items():
        st.markdown(f"- {describe_check(engine, check, cfg)}")


def _stored(db: str) -> None:
    st.subheader("Stored exports")
    try:
        df = stored_exports(db)
    except Exception as e:  # noqa: BLE001
        show_error(e)
        return
    if not len(df):
        st.caption("None yet.")
        return
    st.dataframe(df[["name", "version", "format", "created_at", "content"]].iloc[::-1], hide_index=True)


st.title("Export")
s = settings()
base = _prefill(s.db, s.target, s.draft, s.engine)
try:
    cfg = _form(base, s.target, s.draft)
except ValueError as e:
    show_error(e)
    cfg = None
if cfg is not None:
    _show(cfg, s.db)
    _save(cfg, s.db)
    _directory(cfg)
    _engine_runs(cfg, s.db)
_stored(s.db)
