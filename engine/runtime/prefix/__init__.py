"""Prefix KV reuse across requests: `cache` (RAKV-ASD's cross-request cache in memory) and `disk` (its
disk tier: entries later runs and other processes reuse).

May import: engine.base, engine.runtime."""
