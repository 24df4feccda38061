"""Models at run time: loading a pair at a weight tier (models.py), the distilled draft
(draft_model.py) and EAGLE head (eagle_head.py), batch invariance (invariance.py), the draft's lean body read
(lean_body.py), the target's row-invariant kernels (rowdot.py) and fused Llama read (row_llama.py), every forward
and cache roll-back (forward.py), the cross-request prefix cache (prefix_cache.py), and the KV
cache, its tiers, codec and offload (kv/).

May import: engine.base, engine.datasets (calibration text)."""
