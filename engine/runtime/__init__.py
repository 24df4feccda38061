"""Models at run time: loading a pair at a weight tier (models.py; the embedded model's files in
embedded.py), the distilled draft (draft_model.py) and EAGLE head (eagle_head.py), batch invariance
(invariance.py), the draft's lean body read (lean_body.py), the fused Llama read (row_llama.py),
every forward and cache roll-back (forward.py), a long turn's pause points (preempt.py), llama.cpp
as a target (llamacpp.py); the CPU kernels and their probe (kernels/), the cross-request prefix
cache (prefix/), and the KV cache, its tiers, codec and offload (kv/).

May import: engine.base, engine.datasets (calibration text)."""
