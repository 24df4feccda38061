"""KV caches and tiers (docs/architecture.md, "Where the next parts plug in")."""
from engine.kv.cache import GrowingLayer, new_cache

__all__ = ["GrowingLayer", "new_cache"]
