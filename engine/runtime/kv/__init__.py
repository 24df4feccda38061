"""KV caches and tiers, the KV codec, offload and its modelled pipeline (docs/architecture.md, "KV tiers",
"KV coding", "KV offload"). Import the submodules: some need torch, pipeline.py does not (the tuner reads it).

May import: engine.base, engine.datasets, engine.runtime."""
