"""Training: assemble (build what a run needs), step (one optimizer step), loop (fit), run (a job
end to end), evaluate, recovery (OOM retry, NaN guard, signals), state (what is checkpointed)."""
