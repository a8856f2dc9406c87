"""The planner: predict whether a training setup fits on a GPU and how fast it runs, before running.

arch.py (model shapes on the meta device), activations.py (measured activation bytes),
memory.py (peak memory by component), speed.py (FLOPs over calibrated peak), search.py (candidate
setups, ranked), probe.py (a few real steps of the best candidates; `train --plan auto`).
"""
