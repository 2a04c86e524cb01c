"""Expert budgets: coverage policies, rankings behind one registry, calibration statistics.

The bottom package both capture (online MoE-Spec mode) and replay (open and closed loop) use; it
imports torch and numpy only, never another package of this project.
"""
