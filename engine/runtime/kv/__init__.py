"""KV caches and tiers, the KV codec, offload and the tuner (docs/architecture.md, "KV tiers",
"KV coding", "KV offload"). Import the submodules: some need torch, the tuner and pipeline do not."""
