"""Points between the layers of a forward where a long decode turn may be paused while another
session's first turn runs, then resumed where it stopped.

A decode turn holds the process's decode slot (engine/lab/decode_lock.py) for a whole step, and a step
can be long: a sweep's prefill of a real prompt, a trace step's eight drafts, any step while
browsers take the cores. A session that presses Generate meanwhile waits for all of it. So every
forward passes a `point()` before each decoder layer (HF's layers through a pre-hook, `at_layers`;
the engine's own layer loops call it), and the slot's handler (`install`) may there hand the slot
to a waiting session and wait for it back. The forward then goes on with the same operations on
the same tensors: outputs do not change. Nothing a paused forward holds is shared: each run has its
own cache, and the per-call switches (invariance, kernels) are per thread.

The time a thread spends paused is other decodes' time: `away_ms()` counts it per thread, and the
runs' wall clock leaves it out (forward.WallClock). Without a handler (the CLI, benches) a point
costs a function call; torch-free."""
from __future__ import annotations

import threading
from collections.abc import Callable

_HANDLER: list[Callable[[], float] | None] = [None]  # returns the ms it kept the thread paused
_LOCAL = threading.local()
HOOKED = "speclab_preempt_hooks"  # on a model whose layers pass a point (at_layers)


def point() -> None:
    """Between two layers of a forward: the handler may pause this thread here."""
    handler = _HANDLER[0]
    if handler is not None and (ms := handler()):
        _LOCAL.away = away_ms() + ms


def away_ms() -> float:
    """Milliseconds this thread has spent paused at points, in all."""
    return getattr(_LOCAL, "away", 0.0)


def install(handler: Callable[[], float] | None) -> None:
    """The process's handler (None: points do nothing)."""
    _HANDLER[0] = handler


def at_layers(model) -> None:
    """A point before each of `model`'s decoder layers as HF's forward calls them (once per
    model; the engine's own layer loops call `point` themselves)."""
    if getattr(model, HOOKED, None) is not None or not hasattr(model, "get_decoder"):  # llama.cpp's: no layers here
        return
    layers = getattr(model.get_decoder(), "layers", None) or []
    setattr(model, HOOKED, [layer.register_forward_pre_hook(lambda module, args: point()) for layer in layers])
