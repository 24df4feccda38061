"""Loading target/draft pairs: sources, weight tiers, device, and the embedded default."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.base.helpers import one_line
from engine.base.names import (
    CPU_KERNEL_TIERS,
    EMBEDDED,
    EMBEDDED_GGUF,
    EMBEDDED_LABEL,
    ENGINES,
    EXACT_VERIFY_TIERS,
    FALLBACK_DRAFT_TIER,
    FLOAT_TIER_DTYPES,
    SHIPPED_DRAFT,
    SHIPPED_EAGLE,
    WEIGHT_TIERS,
    tiers_of,
)
from engine.runtime import draft_model as draftlib
from engine.runtime import eagle_head as eaglelib
from engine.runtime import invariance
from engine.runtime.embedded import cache_dir, embedded_dir, gguf_dir, quiet
from engine.runtime.kernels import probe as kernel_probe
from engine.runtime.kernels import rowdot
from engine.runtime.kernels import verify as verify_kernels

FLOAT_TIERS = {tier: getattr(torch, dtype) for tier, dtype in FLOAT_TIER_DTYPES.items()}  # the rest quantize
# The embedded pair's draft scores the 8,192 most frequent target tokens unless its spec says
# otherwise (`@draft:vocab=K`; K = the vocabulary: the full head). bench heads, on held-out text:
# the draft step ~29% cheaper, agreement 0.607 against 0.618, τ at γ 4 unchanged (2.08).
EMBEDDED_DRAFT_VOCAB = 8192


@dataclass
class ModelPair:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object  # a transformers tokenizer, shared by both models
    device: torch.device
    target_name: str
    draft_name: str
    target_tier: str
    draft_tier: str
    vocab_size: int  # logits are compared over this many leading ids (both models cover them)
    eos_ids: frozenset[int]
    max_context: int
    exact_verify: bool = False  # verify forwards run batch-invariant (engine/runtime/invariance.py)
    rowwise_linears: int = 0  # target linears found row-variant and run row by row in verify
    fast_verify_linears: int = 0  # target linears given few-row kernels (runtime/kernels/rowdot.py, kernels/verify.py)
    kernel_set: str = ""  # which: "rowdot-<tier>-<build>" or the machine's probe (runtime/kernels/probe.py)
    draft_row_invariant: bool = False  # the draft reads several tokens at once (invariance.make_row_invariant)
    eagle: object | None = None  # the target's feature-level draft head, when one is loaded (proposer "eagle")
    feature_tap: object | None = None  # keeps the target's final-norm states for it (engine/runtime/eagle_head.py)
    eagle_name: str = ""
    # The draft's reduced-vocabulary heads by size K (vocab_head.sub_head), built at first use. Not
    # an init field: a pair made by dataclasses.replace (another draft) starts with none.
    draft_vocab: int = 0  # the draft's LM head size when its spec names none (0: the full head; runtime/vocab_head.py)
    vocab_heads: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # What runs the target: "torch" (a transformers model) or "llamacpp" (a GGUF through llama.cpp,
    # engine/runtime/llamacpp.py; `target` is then its LlamaModel and `target_tier` its format).
    engine: str = "torch"

    @property
    def target_row_invariant(self) -> bool:
        """At a lossy KV tier the target reads row-invariant (invariance.reads_row_invariant,
        probed at the first ask): speculative output then equals plain decoding at that tier
        whatever the verify's numerics."""
        return self.engine == "torch" and invariance.reads_row_invariant(self.target)


def resolve_device(device: str | None = None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto")
    return torch.device(device)


def device_name(device: torch.device | str) -> str:
    """A device's name in runs, traces and cost tables: `cpu`, or a CUDA device with its model
    (`cuda (NVIDIA H200)`), so that two GPU types never share a cost table and a controller reads
    the table of the device it runs on, whichever machine of a cluster that is."""
    device = torch.device(device)
    if device.type != "cuda":
        return str(device)
    return f"cuda ({torch.cuda.get_device_name(device)})"


def pair_device(pair: "ModelPair") -> str:
    """The device a pair's runs, traces and cost tables are recorded under: its name, and on a CPU
    the verify kernels its target reads through (`[kernels <set>]`), so that a cost table measured
    under other kernels is measured again, never read, and runs under them are told apart."""
    name = device_name(pair.device)
    return f"{name} [kernels {pair.kernel_set}]" if pair.kernel_set else name


def _source_path(source: str | None) -> str:
    return str(embedded_dir()) if source in (None, "", EMBEDDED) else source


def _quantization(tier: str, device: torch.device) -> dict:
    """from_pretrained kwargs for a weight tier."""
    if tier == "fp16" and device.type != "cuda":
        raise ValueError("tier fp16 needs CUDA (CPU fp16 kernels are slow and partial); use bf16 on CPU")
    if tier in FLOAT_TIERS:
        return {"dtype": FLOAT_TIERS[tier]}
    if tier in CPU_KERNEL_TIERS and device.type == "cpu" and (tier == "int4" or rowdot.unavailable() is None):
        if (why := rowdot.unavailable()) is not None:
            raise ValueError(f"tier {tier} on this CPU needs SpecLab's row-invariant kernels: {why}")
        return {"dtype": torch.float32}  # loaded at fp32, quantized by load_model
    if tier == "int4":
        raise ValueError("tier int4 is a CPU tier (SpecLab's kernels); on CUDA use nf4 (bitsandbytes)")
    return _bitsandbytes(tier, device)


def _bitsandbytes(tier: str, device: torch.device) -> dict:
    """from_pretrained kwargs for bitsandbytes' int8/nf4 layers."""
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"tier {tier} needs bitsandbytes: pip install bitsandbytes==0.50.2")
    from transformers import BitsAndBytesConfig

    if tier == "int8":
        bnb = BitsAndBytesConfig(load_in_8bit=True)
    else:
        bnb = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
        )
    return {"dtype": compute, "quantization_config": bnb, "device_map": {"": str(device)}}


def load_model(
    source: str | None, tier: str, device: torch.device, trust_remote_code: bool = False
) -> torch.nn.Module:
    if tier not in WEIGHT_TIERS:
        raise ValueError(f"unknown tier {tier!r}; known: {', '.join(WEIGHT_TIERS)}")
    kwargs = _quantization(tier, device)
    model = _loaded(source, trust_remote_code, kwargs, device)
    if "quantization_config" not in kwargs and tier in CPU_KERNEL_TIERS:  # SpecLab's CPU int8/int4
        if (why := rowdot.refuses(model)) is None:
            rowdot.convert(model, tier)
        elif tier == "int8" and importlib.util.find_spec("bitsandbytes") is not None:
            # a model the kernels cannot read: bitsandbytes' CPU int8 layers, measured by `divergence`
            return _loaded(source, trust_remote_code, _bitsandbytes(tier, device), device)
        else:
            raise ValueError(f"tier {tier} on a CPU reads through SpecLab's {tier} kernels, which cannot read this "
                             f"model ({why}): use fp32 or bf16")
    return model


def _loaded(source: str | None, trust_remote_code: bool, kwargs: dict, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    quiet()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            _source_path(source), trust_remote_code=trust_remote_code, attn_implementation=invariance.register(),
            **kwargs
        )
    except (OSError, EnvironmentError) as e:
        if source and Path(source).is_dir():  # it is there: the reason is something else (a full disk, …)
            raise ValueError(f"cannot load model {source!r}: {one_line(str(e), limit=200)}") from None
        raise ValueError(
            f"cannot load model {source!r}: not a local model directory nor in the local "
            f"Hugging Face cache ({one_line(str(e), limit=200)})"
        ) from None
    if "device_map" not in kwargs:
        model.to(device)
    return model.eval()


def load_tokenizer(source: str | None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(_source_path(source), trust_remote_code=trust_remote_code)
    except (OSError, EnvironmentError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer of {source!r} ({one_line(str(e), limit=200)})") from None


def check_vocab(t_tok, d_tok, t_vocab: int, d_vocab: int, draft_name: str) -> int:
    """The number of leading logit ids both models share; refuses pairs that disagree."""
    if t_tok.get_vocab() != d_tok.get_vocab():
        raise ValueError(
            f"draft {draft_name!r} has a different vocabulary from the target "
            f"({len(d_tok)} vs {len(t_tok)} tokens); speculative decoding needs a shared tokenizer"
        )
    shared = min(t_vocab, d_vocab)
    if shared < len(t_tok):
        raise ValueError(
            f"draft {draft_name!r} outputs {d_vocab} logits, fewer than the tokenizer's {len(t_tok)}"
        )
    return shared


def eos_ids_of(tokenizer, model) -> frozenset[int]:
    ids: set[int] = set()
    for v in (tokenizer.eos_token_id, model.generation_config.eos_token_id, model.config.eos_token_id):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return frozenset(ids)


def _draft_source(target: str | None, draft: str | None, draft_tier: str | None,
                  dev: torch.device) -> tuple[str | None, str, str, bool]:
    """(draft source, its tier, its name, a SpecLab draft?). The embedded target's default draft is
    the distilled one shipped in engine/data/drafts/; a target with no draft given is drafted by
    itself at nf4. A SpecLab draft's numerics only change what is proposed, never what is emitted:
    it runs at bf16, far cheaper than fp32 per token on AVX512-BF16 CPUs and on GPUs."""
    if draft in (None, "") and target in (None, "", EMBEDDED) and draftlib.is_draft_dir(SHIPPED_DRAFT):
        draft = str(SHIPPED_DRAFT)
    if draft in (None, ""):
        draft, draft_tier = target, draft_tier or FALLBACK_DRAFT_TIER
    if draftlib.is_draft_dir(draft):
        return draft, draft_tier or "bf16", draftlib.label(draft), True
    name = EMBEDDED_LABEL if draft in (None, "", EMBEDDED) else draft
    return draft, draft_tier or ("bf16" if dev.type == "cuda" else "fp32"), name, False


def load_pair(
    target: str | None = None,
    draft: str | None = None,
    target_tier: str | None = None,
    draft_tier: str | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
    progress: Callable[[str], None] = lambda msg: None,
    exact_verify: bool | None = None,
    eagle: str | None = None,
    engine: str = "torch",
) -> ModelPair:
    """Target and draft on one device (`None`/"embedded": the embedded default), each made ready
    for its duty: the target's verify batch-invariant where its tier needs it, the draft's reads
    row-invariant (engine/runtime/invariance.py; docs/architecture.md, "Exactness and invariance").
    `engine` "llamacpp": the target through llama.cpp, `target_tier` its GGUF format (load_llama_pair).
    `target_tier` None: fp32 on torch, the GGUF as shipped (q4_1) on llama.cpp."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    target_tier = target_tier or tiers_of(engine)[0][0]  # the engine's default: fp32, or the GGUF as shipped
    if engine == "llamacpp":
        if device not in (None, "", "auto", "cpu"):
            raise ValueError(f"the llama.cpp engine runs on the CPU here, not {device!r}")
        if eagle not in (None, "", "off"):
            raise ValueError("an EAGLE head reads the target's hidden states, which llama.cpp does not hand out")
        return load_llama_pair(target, draft, target_tier, draft_tier, trust_remote_code, progress)
    dev = resolve_device(device)
    target_name = EMBEDDED_LABEL if target in (None, "", EMBEDDED) else target
    draft, draft_tier, draft_name, speclab_draft = _draft_source(target, draft, draft_tier, dev)
    progress(f"loading target {target_name} ({target_tier}) on {dev}")
    t_model = load_model(target, target_tier, dev, trust_remote_code)
    tokenizer = load_tokenizer(target, trust_remote_code)
    # The row-invariant kernels where they serve the target (an int8/int4 CPU tier has no others):
    # every CPU tier is then exact by default, at a verify's cost close to a plain step's.
    rowinv = exact_verify is not False or rowdot.converted(t_model)[0] > 0
    kernel_set = _row_invariant_kernels(t_model, target_tier, dev, progress) if rowinv else ""
    # bitsandbytes layers are measured by `divergence` instead
    exact = exact_verify if exact_verify is not None else bool(kernel_set) or target_tier in EXACT_VERIFY_TIERS
    rowwise = invariance.make_verify_exact(t_model) if exact else 0
    if not exact and not kernel_set:
        kernel_set = kernel_probe.make_verify_fast(t_model, progress)
    fast = rowdot.converted(t_model)[0] or verify_kernels.patched(t_model)
    d_model, draft_rowinv, vocab = _draft_model(target, draft, draft_tier, draft_name, speclab_draft, dev, t_model,
                                                tokenizer, t_model.config.get_text_config().vocab_size,
                                                trust_remote_code, progress)
    head, head_name = _eagle_head(target, eagle, t_model, dev, progress)
    return ModelPair(
        target=t_model, draft=d_model, tokenizer=tokenizer, device=dev, target_name=target_name,
        draft_name=draft_name, target_tier=target_tier, draft_tier=draft_tier, vocab_size=vocab,
        eos_ids=eos_ids_of(tokenizer, t_model),
        max_context=int(getattr(t_model.config.get_text_config(), "max_position_embeddings", 1 << 30)),
        exact_verify=exact, rowwise_linears=rowwise, fast_verify_linears=fast, kernel_set=kernel_set,
        draft_row_invariant=draft_rowinv,
        draft_vocab=EMBEDDED_DRAFT_VOCAB if speclab_draft and target in (None, "", EMBEDDED) else 0,
        eagle=head, feature_tap=eaglelib.FeatureTap(t_model) if head is not None else None, eagle_name=head_name,
    )


def _draft_model(target: str | None, draft: str | None, draft_tier: str, draft_name: str, speclab_draft: bool,
                 dev: torch.device, t_model, tokenizer, t_vocab: int, trust_remote_code: bool,
                 progress) -> tuple[torch.nn.Module, bool, int]:
    """(the draft, reads row-invariant?, the logit ids both models share), whichever engine runs
    the target (`t_model` None on llama.cpp: a SpecLab draft's embedding comes from the files)."""
    progress(f"loading draft {draft_name} ({draft_tier})")
    if speclab_draft:  # it shares the target's tokenizer, embedding and LM head
        if draft_tier not in FLOAT_TIERS:
            raise ValueError(f"a SpecLab draft runs at {', '.join(FLOAT_TIERS)}, not {draft_tier}")
        embedding = draftlib.target_embedding(_source_path(target), t_model)
        d_model, d_tok = draftlib.load_draft(draft, embedding, dev, FLOAT_TIERS[draft_tier], int8=True), tokenizer
    else:
        d_model = load_model(draft, draft_tier, dev, trust_remote_code)
        d_tok = tokenizer if draft == target else load_tokenizer(draft, trust_remote_code)
    # On a CPU the draft reads through the target's kernels too (fused, row-invariant by
    # construction); elsewhere, or where they cannot read it, row invariance is probed for.
    draft_rowinv = (dev.type == "cpu" and rowdot.convert_draft(d_model)) or invariance.make_row_invariant(d_model)
    if not draft_rowinv:  # it reads row by row, batch-invariant
        invariance.make_verify_exact(d_model)
    vocab = check_vocab(tokenizer, d_tok, t_vocab, d_model.config.get_text_config().vocab_size, draft_name)
    return d_model, draft_rowinv, vocab


def load_llama_pair(target: str | None = None, draft: str | None = None, fmt: str = "q4_1",
                    draft_tier: str | None = None, trust_remote_code: bool = False,
                    progress: Callable[[str], None] = lambda msg: None) -> ModelPair:
    """The target through llama.cpp at GGUF format `fmt` (None/"embedded": the embedded model's
    GGUF, else a .gguf file), the draft in torch on the CPU as on the torch engine. The load
    settings come from a probe in a child process (engine/runtime/llamacpp.py)."""
    from engine.runtime import llamacpp

    llamacpp.check_format(fmt)
    if (why := llamacpp.unavailable()) is not None:
        raise ValueError(why)
    embedded = target in (None, "", EMBEDDED)
    source = gguf_dir() / EMBEDDED_GGUF if embedded else Path(target)
    if not embedded and (source.suffix != ".gguf" or not source.is_file()):
        raise ValueError(f"the llama.cpp engine reads a .gguf file; {target!r} is not one")
    head = llamacpp.check_llama_family(source)
    if not embedded and (draft in (None, "") or draftlib.is_draft_dir(draft)):
        raise ValueError("a GGUF target other than the embedded one needs --draft: a Hugging Face model sharing "
                         "its vocabulary (a SpecLab draft reads the embedded target's embedding)")
    dev = torch.device("cpu")
    progress(f"llama.cpp: {source.name} at {fmt}")
    path = llamacpp.gguf_at(source, fmt, cache_dir() / "gguf")
    threads = torch.get_num_threads()
    probe = llamacpp.probe(path, threads, cache_dir())
    t_model = llamacpp.LlamaModel(path, fmt, threads, probe.extra_bufts)
    if t_model.n_vocab != head["n_vocab"]:
        raise ValueError(f"{path.name}: llama.cpp reads {t_model.n_vocab} tokens, the file lists {head['n_vocab']}")
    tokenizer = load_tokenizer(None) if embedded else _gguf_tokenizer(source)
    target_name = EMBEDDED_LABEL if embedded else source.name
    draft, draft_tier, draft_name, speclab_draft = _draft_source(target if not embedded else None, draft, draft_tier, dev)
    d_model, draft_rowinv, vocab = _draft_model(None if embedded else target, draft, draft_tier, draft_name,
                                                speclab_draft, dev, None, tokenizer, t_model.n_vocab,
                                                trust_remote_code, progress)
    eos = frozenset(i for i in t_model.eog_ids() if i < vocab) | (
        {tokenizer.eos_token_id} if isinstance(tokenizer.eos_token_id, int) else set())
    kernels = f"llamacpp-{llamacpp.version()}" + ("-repack" if probe.extra_bufts else "")
    return ModelPair(
        target=t_model, draft=d_model, tokenizer=tokenizer, device=dev, target_name=target_name,
        draft_name=draft_name, target_tier=fmt, draft_tier=draft_tier, vocab_size=vocab, eos_ids=frozenset(eos),
        max_context=t_model.n_ctx, exact_verify=False, kernel_set=kernels, draft_row_invariant=draft_rowinv,
        draft_vocab=EMBEDDED_DRAFT_VOCAB if speclab_draft and embedded else 0, engine="llamacpp",
    )


def _gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    quiet()
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the tokenizer of {path.name} ({one_line(str(e), limit=200)})") from None


def _row_invariant_kernels(model: torch.nn.Module, tier: str, dev: torch.device, progress) -> str:
    """Gives a CPU target's linears the row-invariant kernels at its tier (runtime/kernels/rowdot.py) and
    names the kernel set; "" where they do not run or cannot read the model, or its layers are
    bitsandbytes' (then an exact verify reads row by row: invariance.make_verify_exact)."""
    if dev.type != "cpu" or tier not in rowdot.FORMATS or rowdot.unavailable() is not None:
        return ""
    if getattr(model, "hf_quantizer", None) is not None:
        return ""
    if rowdot.converted(model)[0] == 0:
        if rowdot.refuses(model) is not None:
            return ""
        progress(f"row-invariant {tier} kernels for the target")
        rowdot.convert(model, tier)
    tiles = any(isinstance(m, rowdot.RowLinear) and m.tensors[0].dim() == 4 for m in model.modules())
    return f"rowdot-{tier}-{rowdot.build_id()}" + ("-amx" if tiles else "")  # AMX tiles round bf16 their own way


def _eagle_head(target: str | None, eagle: str | None, t_model, dev: torch.device, progress) -> tuple[object | None, str]:
    """The EAGLE head: `eagle` a head directory, "off" none, None the shipped one of the embedded
    target (when it is there). It runs at fp32 on CPUs without fast bf16 matmuls, bf16 on CUDA."""
    if eagle == "off" or (eagle in (None, "") and target not in (None, "", EMBEDDED)):
        return None, ""
    path = eagle or str(SHIPPED_EAGLE)
    if not eaglelib.is_head_dir(path):
        if eagle:
            raise ValueError(f"{eagle!r} is not an EAGLE head directory (no {eaglelib.MARKER})")
        return None, ""
    progress(f"loading EAGLE head {Path(path).name}")
    embedding = draftlib.target_embedding(_source_path(target), t_model)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return eaglelib.load_head(path, embedding, dev, dtype), eaglelib.label(path)
