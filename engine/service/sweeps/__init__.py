"""Profiling sweeps, the user action that fills the store: `serial` (one process, resumable, a failing
cell stored as failed), `jobs` (the Profile page's background sweep, one per process), `cluster`
and `cluster_sweep` (the same cells on Ray, docs/scale.md).

May import: what engine.service may (engine.base … engine.training, store)."""
