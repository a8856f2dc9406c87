"""The calculator job's set-up (training/tool_default.py): its warm-up run's settings, and which
earlier warm-up runs it reuses."""

from __future__ import annotations

from pathlib import Path

from onegpu.config import Config, load_yaml, save_yaml
from onegpu.training import tool_default


def _job(runs: Path) -> Config:
    cfg = Config()
    cfg.training.objective, cfg.output.dir = "grpo", str(runs)
    cfg.grpo.tools = ["calculator"]
    return cfg


def _finished(run: Path, cfg: Config) -> Path:
    """A run folder as training leaves it: its config and a final model."""
    (run / "final").mkdir(parents=True)
    save_yaml(cfg, run / "config.yaml")
    (run / "final" / "config.json").write_text("{}")
    return run / "final"


def test_the_warm_up_splits_digits_and_a_finished_one_is_reused(tmp_path):
    runs = tmp_path / "runs"
    seen: list[Config] = []

    def train_warmup(base: Config) -> Path:
        seen.append(base)
        return _finished(runs / "warmup", base)

    settled = tool_default.settle(_job(runs), train_warmup)
    (base,) = seen
    assert base.model.split_digits and base.data.seq_len == 96
    assert settled.model.name == str(runs / "warmup" / "final")
    assert not settled.model.split_digits  # the policy loads the warm-up's own tokenizer
    assert settled.grpo.rewards == ["calculator_answer"]
    tool_default.settle(_job(runs), train_warmup)  # the finished warm-up serves the next job
    assert len(seen) == 1


def test_a_warm_up_trained_with_other_settings_is_not_reused(tmp_path):
    runs = tmp_path / "runs"
    tool_default.settle(_job(runs), lambda base: _finished(runs / "new", base))
    new = runs / "new" / "config.yaml"
    warmup_file = Path(load_yaml(new)["data"]["path"])
    assert tool_default.newest_final(runs, warmup_file) == runs / "new" / "final"
    (runs / "new" / "final" / "config.json").unlink()  # unfinished: not a candidate
    old = Config()
    old.data.path = str(warmup_file)
    for section, name, value in tool_default.WARMUP:
        setattr(getattr(old, section), name, value)
    old.model.split_digits = False  # as warm-ups were trained before digits were split
    _finished(runs / "old", old)
    assert tool_default.newest_final(runs, warmup_file) is None
