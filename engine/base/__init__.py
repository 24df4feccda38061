"""What every layer shares, torch-free: the shared names (names.py: tiers, the embedded model, the
shipped draft and head, DATA_DIR, the cost key) and small helpers (helpers.py: the default database,
one-line errors, the median timer).

May import: store (the bottom layer) only."""
