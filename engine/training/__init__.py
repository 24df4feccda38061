"""Making and fitting what drafts and decides: the distilled draft (distill.py; its configuration
in distill_config.py, its data stage in distill_data.py), the EAGLE head
(eagle_distill.py) and the learned γ controller fitted from traces or runs (retrain.py).

May import: engine.base, engine.datasets, engine.decode, engine.runtime, engine.oracles, engine.lab."""
