"""The two oracles the step loop (engine/step.py) walks: proposers and verifiers backed by live
models (model.py) or by stored acceptance traces (trace.py)."""
