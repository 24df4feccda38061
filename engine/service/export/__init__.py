"""The configuration a user leaves with: `tuned_config` (TunedConfig ↔ JSON/YAML), `formats` (HF
`generate` kwargs, vLLM's `speculative_config`, stored exports), `model_dir` (a directory that runs
in the engine it names), `llamacpp` (llama.cpp's flags and GGUFs) and `pinned_fields` (the pinned
vLLM release's field names, read from its wheel).

May import: what engine.service may (engine.base … engine.training, store)."""
