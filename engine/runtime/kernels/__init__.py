"""What the CPU runs the target's reads with, chosen where it runs: `rowdot` (row-invariant linears
and attention, csrc/rowdot.cpp, built for the machine), `verify` (the few-row kernel candidates),
`probe` (times them per weight shape and row count, keeps the fastest exact one), `int8` (int8
weights through torch's int8 matmul) and `threads` (the thread count per pair, probed).

May import: engine.base, engine.runtime."""
