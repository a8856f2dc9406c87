"""The default job end to end (shrunk), its outputs, and fine-tuning a saved model."""

import json

import pytest

from onegpu import train
from onegpu.report import read_metrics

SMALL = {
    "data": {"max_bytes": 300_000, "seq_len": 64, "num_proc": 1},
    "training": {
        "micro_batch_size": 8,
        "max_steps": 20,
        "eval_every": 10,
        "eval_batches": 4,
        "warmup_steps": 5,
        "log_every": 5,
        "lr": 3e-3,
    },
}


def _cfg(tmp_path, **extra):
    cfg = json.loads(json.dumps(SMALL))
    cfg["output"] = {"dir": str(tmp_path), "name": "run"}
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def test_default_job_writes_run_dir_and_learns(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = train(_cfg(tmp_path))
    run = tmp_path / "run"
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "loss.png",
        "final/model.safetensors",
        "final/tokenizer.json",
    ):
        assert (run / name).is_file(), name
    assert any((run / "tensorboard").iterdir())
    recs = read_metrics(run / "metrics.jsonl")
    val = [x["loss"] for x in recs if x["split"] == "val"]
    assert len(val) >= 3 and val[-1] < val[0] - 0.5  # clearly falling
    train_recs = [x for x in recs if x["split"] == "train"]
    assert all(x["tokens_per_s"] > 0 and x["memory_gb"] > 0 for x in train_recs)
    assert r.first_eval == val[0] and r.last_eval == val[-1]
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.model_type == "llama" and tok.pad_token_id != tok.eos_token_id


def test_fine_tune_local_model_on_prompt_completion(tmp_path, tiny_model_dir):
    data = tmp_path / "pc.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{i} plus 1 is", "completion": f" {i + 1}"}) + "\n"
            for i in range(64)
        ),
        encoding="utf-8",
    )
    cfg = _cfg(
        tmp_path,
        model={"name": str(tiny_model_dir)},
        data={"path": str(data), "val_fraction": 0.1},
        training={"max_steps": 6, "eval_every": 0, "micro_batch_size": 4},
    )
    r = train(cfg)
    assert r.state.step == 6 and (tmp_path / "run" / "final" / "config.json").is_file()


def test_refuses_non_empty_run_dir(tmp_path):
    from onegpu.errors import ConfigError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("precious")
    with pytest.raises(ConfigError, match="not empty"):
        train(_cfg(tmp_path))
    assert (tmp_path / "run" / "keep.txt").read_text() == "precious"


def test_lr_schedule_warmup_then_cosine():
    from onegpu.config import TrainingConfig
    from onegpu.training.assemble import lr_schedule

    f = lr_schedule(TrainingConfig(max_steps=100, warmup_steps=10, min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) < f(20) < 1.0 and f(100) == pytest.approx(0.1)


def test_two_jobs_in_one_process_with_different_precisions(tmp_path):
    """Accelerate keeps one precision per process; each train() call must still get its own:
    the first job's matmuls run in fp16 (with a loss scaler), the second's in fp32 again."""
    import torch

    from onegpu.training.state import Callback

    class MatmulDtypes(Callback):
        def __init__(self):
            self.seen, self.scaled = set(), None

        def on_train_begin(self, run, state):
            first = next(m for m in run.model.modules() if isinstance(m, torch.nn.Linear))
            self.hook = first.register_forward_hook(lambda mod, args, out: self.seen.add(out.dtype))

        def on_train_end(self, run, state):
            self.hook.remove()

    base = {
        "data": {"max_bytes": 60_000, "seq_len": 32, "num_proc": 1, "val_fraction": 0.0},
        "training": {"micro_batch_size": 2, "max_steps": 1, "eval_every": 0},
    }
    seen = {}
    for i, precision in enumerate(["fp16", "fp32", "fp16"]):
        cfg = json.loads(json.dumps(base))
        cfg["techniques"] = {"precision": precision}
        cfg["output"] = {"dir": str(tmp_path), "name": f"r{i}"}
        watch = MatmulDtypes()
        assert train(cfg, callbacks=[watch]).state.step == 1
        seen[i] = watch.seen
    assert seen == {0: {torch.float16}, 1: {torch.float32}, 2: {torch.float16}}


def test_library_entry_point_is_onegpu_train():
    import inspect

    import onegpu
    import onegpu.training.run  # noqa: F401  (importing the training package does not shadow it)

    assert (
        inspect.isfunction(onegpu.train)
        and "callbacks" in inspect.signature(onegpu.train).parameters
    )


def test_summary_line_adds_up(tmp_path, tiny_model_dir, capsys):
    """The end-of-run line's tokens over its seconds give its tokens/s: the rate is over the steps'
    own time, and that is the time next to it; the whole process's time is shown apart."""
    import re

    from helpers import make_cfg

    result = train(make_cfg(tmp_path, tiny_model_dir, max_steps=4, save_every=2, eval_every=2))
    out = capsys.readouterr().out
    m = re.search(
        r"done: 4 steps, ([\d,]+) tokens trained in ([\d.,]+)s of training steps \(([\d,]+) "
        r"tokens/s; ([\d.,]+)s in all, with start-up, evaluation and saving\)",
        out,
    )
    assert m, out
    tokens, seconds, rate, wall = (float(g.replace(",", "")) for g in m.groups())
    assert tokens == result.state.trained_tokens
    assert seconds == pytest.approx(result.state.timed_seconds, abs=0.51)  # shown rounded
    assert rate == pytest.approx(tokens / result.state.timed_seconds, abs=1)
    assert wall == pytest.approx(result.wall_seconds, abs=0.51) and wall >= seconds
