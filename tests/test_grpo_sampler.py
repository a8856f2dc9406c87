"""The sampler-trainer mismatch of GRPO's rollouts: the engine's own log-probs of the sampled
tokens reach the loss, the mismatch against the training forward is logged every step (corrected
or not), and a correction that the sampler's log-probs cannot support is a clear error."""

from __future__ import annotations

import pytest

import onegpu
from onegpu.config import from_dict, validate
from onegpu.errors import ConfigError
from test_grpo import grpo_cfg, metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("correction", ["off", "tis"])
def test_the_mismatch_is_logged_every_step(tmp_path, tiny_model_dir, correction):
    cfg = grpo_cfg(
        tmp_path, tiny_model_dir, max_steps=2, log_every=1, save_every=0, eval_every=0,
        grpo={"sampler_correction": correction},
    )  # fmt: skip
    result = onegpu.train(cfg)
    rows = metrics(result.run_dir)
    assert len(rows) == 2
    for r in rows:
        # fp32 on a CPU: the engine's step and the training forward agree to rounding, not bits
        assert 0 <= r["sampler_logp_diff_mean"] <= r["sampler_logp_diff_max"] < 1e-2
        assert 0 <= r["sampler_kl"] < 1e-4


def test_a_correction_without_the_samplers_own_log_probs_is_an_error(tmp_path, tiny_model_dir):
    for grpo, match in (
        ({"temperature": 0.7}, "temperature 1"),
        ({"sampler": "generate"}, "grpo.sampler=engine"),
        ({"top_k": 5}, "top_k 0"),
    ):
        cfg = grpo_cfg(tmp_path, tiny_model_dir, grpo={"sampler_correction": "mis", **grpo})
        with pytest.raises(ConfigError, match=match):
            validate(from_dict(cfg))
