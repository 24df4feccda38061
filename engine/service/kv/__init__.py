"""The KV side as actions: `measure` (`bench kv`'s measurement, stored), `actions` (what the KV &
prefetch page and the CLI call), `tuner` (tier and prefetch window from the measurement),
`preset` (the SpecKV notes' starting point before anything is measured) and `figures`.

May import: what engine.service may (engine.base … engine.training, store)."""
