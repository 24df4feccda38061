"""What this machine's steps cost: `tables` (cost tables per pair, tier and context, read by the
cost-aware policies, and the acceptance priors), `jobs` (measuring them in turns of the decode
slot) and `kernels` (the verify kernels the probe chose, as the CLI and the Profile page show them).

May import: what engine.service may (engine.base … engine.training, store)."""
