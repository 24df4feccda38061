"""What engine/runtime/llamacpp.py runs in a child process, where a crash of native code ends
only the child: `probe FILE EXTRA THREADS` (load with the repacked kernels on or off, decode a
prompt and a few single tokens) and `quantize SRC DST FTYPE` (llama_model_quantize)."""
from __future__ import annotations

import sys
from pathlib import Path


def _probe(path: str, extra: str, threads: str) -> None:
    from engine.runtime.llamacpp import LlamaModel

    model = LlamaModel(Path(path), "probe", int(threads), extra == "1", n_ctx=256)
    ctx = model.lease("native")
    logits = ctx.read(list(range(1, 17)), 2)  # a batched read, as a prefill or a verify
    for _ in range(3):  # single-token reads, as plain steps
        logits = ctx.read([int(logits[-1].argmax())], 1)
    assert logits.shape == (1, model.n_vocab), logits.shape
    print("ok")


def _quantize(src: str, dst: str, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize returned {rc}")
    print("ok")


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    {"probe": _probe, "quantize": _quantize}[what](*args)
