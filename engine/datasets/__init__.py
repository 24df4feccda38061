"""Prompts and outside data: the workbench's prompt sets (prompts.py), ShareGPT V3 and HumanEval
read from their PyPI wheels (sharegpt.py, humaneval.py), and SpecKV's step CSV turned into runs
(speckv.py).

May import: engine.base, store."""
