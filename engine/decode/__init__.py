"""The decode loop and what it decides with, plain Python and numpy (no torch): the one step loop
(step.py), the records crossing boundaries (records.py), cost tables (costs.py), the γ policies
(policies/) and the learned acceptance predictor (acceptance.py). Live runs and replay both walk
step.decode.

May import: engine.base."""
