"""KV caches and tiers (DESIGN.md, "KV tiers, speculative coding, prefetch")."""
from engine.kv.cache import GrowingLayer, new_cache

__all__ = ["GrowingLayer", "new_cache"]
