"""TrainState: one shape of the evaluation history whatever ended the run, and what this process
trained kept apart from what the checkpoint it resumed from had."""

from __future__ import annotations

import json

from onegpu.training.state import TrainState


def test_history_is_step_loss_pairs_through_a_checkpoint():
    state = TrainState(step=6, tokens_seen=600, history=[(0, 5.5), (3, 4.25), (6, 3.0)])
    assert (state.first_eval, state.last_eval) == (5.5, 3.0)
    saved = json.loads(json.dumps(state.to_dict()))  # state.json: tuples become lists
    assert saved["eval_loss"] == 3.0
    restored = TrainState.from_dict(saved)
    assert restored.history == [(0, 5.5), (3, 4.25), (6, 3.0)]
    assert all(isinstance(h, tuple) and isinstance(h[1], float) for h in restored.history)
    assert (restored.first_eval, restored.last_eval) == (5.5, 3.0)
    assert TrainState().first_eval is None and TrainState().last_eval is None


def test_a_resumed_state_counts_from_the_checkpoint():
    restored = TrainState.from_dict(
        TrainState(step=3, tokens_seen=300, history=[(0, 5.0)]).to_dict()
    )
    assert (restored.trained_steps, restored.trained_tokens) == (0, 0)
    restored.step, restored.tokens_seen = 6, 640
    assert (restored.trained_steps, restored.trained_tokens) == (3, 340)
    fresh = TrainState(step=6, tokens_seen=640)
    assert (fresh.trained_steps, fresh.trained_tokens) == (6, 640)
