"""Runs: a live generation (generation.py), exact what-if replay of traces (whatif.py), traces and
cost measurement (profiling.py), speculative vs plain divergence (divergence.py), the figures of a
side-by-side comparison (side_by_side.py) and the process-wide decode slot (decode_lock.py).

May import: engine.base, engine.datasets, engine.decode, engine.runtime, engine.oracles."""
