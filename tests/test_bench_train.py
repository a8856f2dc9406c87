"""`onegpu bench train`: interleaved arms in fresh processes, HF Trainer on the same tokens,
reports."""

from __future__ import annotations

import json
import statistics

import pytest

from onegpu.bench import arms as bench_arms
from onegpu.bench import train as bench_train
from onegpu.bench import train_report as bench_train_report
from onegpu.bench.train import BenchTrainConfig
from onegpu.bench.train_child import timing_from_windows
from onegpu.errors import ConfigError
from onegpu.hardware import DeviceInfo

CPU = DeviceInfo("cpu", "CPU", 8 * 2**30)
H100 = DeviceInfo("cuda", "NVIDIA H100", 80 * 2**30, (9, 0))


def bench_config(**kw) -> BenchTrainConfig:
    """BenchTrainConfig with dotted overrides ('data.seq_len', 'bench.reps'), as the CLI takes
    them."""
    b = BenchTrainConfig()
    for dotted, value in kw.items():
        section, key = dotted.split("__")
        setattr(getattr(b, section), key, value)
    return b


def tiny_bench(model_dir, data, tmp_path, **kw) -> BenchTrainConfig:
    base = dict(
        model__name=str(model_dir),
        model__from_scratch=False,
        data__path=str(data),
        data__seq_len=32,
        training__micro_batch_size=2,
        training__grad_accum=1,
        training__max_steps=2,
        bench__warmup_steps=1,
        bench__reps=2,
        bench__arms="baseline,hf-trainer",
        bench__max_seconds=60,
        bench__out=str(tmp_path / "results"),
        bench__name="bench",
    )
    base.update(kw)
    return bench_config(**base)


@pytest.mark.slow
def test_two_arms_two_reps_end_to_end(tiny_model_dir, text_file, tmp_path):
    """Real children: our loop and HF Trainer, each twice, interleaved; json, md and png written."""
    b = tiny_bench(tiny_model_dir, text_file, tmp_path)
    paths = bench_train.run(b)
    doc = json.loads(paths["json"].read_text())

    assert [(s["rep"], s["arm"]) for s in doc["schedule"]] == [
        (0, "baseline"),
        (0, "hf-trainer"),
        (1, "baseline"),
        (1, "hf-trainer"),
    ]
    starts = [s["start"] for s in doc["schedule"]]
    assert starts == sorted(starts)
    assert {"device", "versions", "command", "date", "setup"} <= set(doc)
    assert (
        doc["versions"]["torch"]
        and doc["setup"]["peak_flops"] > 0
        and doc["setup"]["flops_per_token"] > 0
    )

    ours, hf = doc["arms"]["baseline"], doc["arms"]["hf-trainer"]
    for arm in (ours, hf):
        assert arm["status"] == "ok" and len(arm["reps"]) == 2
        for r in arm["reps"]:
            assert r["status"] == "ok" and r["timed_steps"] == 1 and r["steps_done"] == 2
            assert r["tokens_per_s"] > 0 and r["samples_per_s"] > 0 and 0 < r["mfu"] < 1
            assert r["train_mem_mb"] > 0 and r["final_loss"] > 0
    # The same examples in the same order: both loops count exactly the same real tokens.
    for a, h in zip(ours["reps"], hf["reps"], strict=True):
        assert a["tokens_seen"] == h["tokens_seen"] > 0
        assert a["timed_tokens"] == h["timed_tokens"] > 0
    assert ours["final_loss"] == pytest.approx(
        hf["final_loss"], rel=0.05
    )  # same model, data and schedule

    # Ratios pair each round's arm with that round's baseline, then take the median.
    paired = lambda key, a, b: statistics.median(  # noqa: E731
        x[key] / y[key] for x, y in zip(a["reps"], b["reps"], strict=True)
    )
    assert ours["speed_x"] == pytest.approx(1.0) and ours["memory_x"] == pytest.approx(1.0)
    assert hf["speed_x"] == pytest.approx(paired("tokens_per_s", hf, ours))
    assert hf["memory_x"] == pytest.approx(paired("train_mem_mb", hf, ours))
    assert doc["vs_hf_trainer"]["baseline"]["speed_x"] == pytest.approx(
        paired("tokens_per_s", ours, hf)
    )
    assert all(
        r["peak_flops"] > 0 for r in ours["reps"] + hf["reps"]
    )  # each child measures its own peak
    assert ours["reps"][0]["evidence"]["optimizer"].endswith("AdamW")
    assert (
        hf["reps"][0]["evidence"]["fused"] is True
    )  # Trainer's default optimizer here: fused AdamW

    md = paths["md"].read_text()
    assert "| Method (guide row) | arm |" in md and "| HF Trainer, defaults | hf-trainer |" in md
    assert "speed x" in md and "memory x" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def chat_file(path):
    """Chat records of different lengths: labels only on the assistant turns, padding in every
    batch."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} squared?" + " Explain." * (i % 4)},
                {
                    "role": "assistant",
                    "content": f"{i} squared is {i * i}." + " Because." * (i % 5),
                },
            ]
        }
        for i in range(60)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("data", ["text", "chat"])
def test_trl_arm_trains_on_the_same_tokens(data, tiny_model_dir, text_file, tmp_path):
    """TRL's SFTTrainer at its defaults, in a real child: the same examples in the same order as our
    loop (so the same token counts), a loss close to ours, and evidence of what TRL itself chose."""
    path, seq = (text_file, 32) if data == "text" else (chat_file(tmp_path / "chat.jsonl"), 128)
    b = tiny_bench(
        tiny_model_dir, path, tmp_path, bench__arms="trl-sft", bench__reps=1, data__seq_len=seq
    )
    paths = bench_train.run(b)
    doc = json.loads(paths["json"].read_text())
    assert doc["setup"]["data_format"] == ("text" if data == "text" else "messages")
    ours, trl = doc["arms"]["baseline"], doc["arms"]["trl-sft"]
    assert trl["status"] == "ok" and trl["kind"] == "trl", trl.get("reason")
    (a,), (t,) = ours["reps"], trl["reps"]
    assert t["status"] == "ok" and t["steps_done"] == a["steps_done"] == 2 and t["timed_steps"] == 1
    assert t["tokens_seen"] == a["tokens_seen"] > 0 and t["timed_tokens"] == a["timed_tokens"] > 0
    if data == "chat":  # examples of different lengths: padding in the batches, counted by neither
        assert a["tokens_seen"] < 2 * 2 * seq
    # Same model, data and schedule; TRL's default bf16 autocast (fp32 here) moves the loss a little
    # only.
    assert trl["final_loss"] == pytest.approx(ours["final_loss"], rel=0.05)
    ev = t["evidence"]
    assert (
        ev["loss_type"] in ("nll", "chunked_nll") and ev["chunked_loss"] is True
    )  # TRL >= 1.7's default
    assert (
        ev["loss_normalisation"] == "summed over the target tokens of the accumulated batch"
    )  # as ours
    assert ev["precision"] == "bf16" and ev["checkpointing"] is True  # TRL's own defaults, recorded
    assert ev["optimizer"].endswith("AdamW") and ev["trl"]
    assert doc["vs_trl_sft"]["baseline"]["speed_x"] == pytest.approx(
        a["tokens_per_s"] / t["tokens_per_s"]
    )
    md = paths["md"].read_text()
    assert "vs TRL SFTTrainer (defaults) (" in md and "| TRL SFTTrainer, defaults | trl-sft |" in md
    assert "chunked loss" in md


def test_interleaving_and_ratios_with_many_arms(tiny_model_dir, text_file, tmp_path):
    """Three arms x three reps run A, B, C, A, B, C, A, B, C; ratios are medians over the
    baseline's."""
    b = tiny_bench(
        tiny_model_dir,
        text_file,
        tmp_path,
        bench__arms="hf-trainer,grad-accum,flash",
        bench__reps=3,
    )
    calls = []

    def runner(spec):  # stands in for the subprocess: throughput grows with the call index
        calls.append(spec)
        n = len(calls)
        return {
            "status": "ok",
            "rep": spec["rep"],
            "timed_steps": 1,
            "timed_tokens": 100 * n,
            "timed_seconds": 1.0,
            "train_mem_mb": 10.0 * n,
            "peak_mem_mb": 500.0,
            "final_loss": 1.0,
            "evidence": {},
        }

    doc = bench_train.run_sweep(b, runner=runner)
    order = [s["arm"] for s in doc["schedule"]]
    assert order == ["baseline", "hf-trainer", "grad-accum"] * 3
    assert [c["rep"] for c in calls] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert (
        calls[2]["config"]["training"]["micro_batch_size"] == 1
    )  # grad-accum: smaller micro-batches...
    assert calls[2]["config"]["training"]["grad_accum"] == 2  # ...same effective batch
    assert doc["arms"]["flash"]["status"] == "skipped" and "CUDA" in doc["arms"]["flash"]["reason"]
    assert doc["arms"]["baseline"]["tokens_per_s"] == 400  # calls 1, 4, 7
    # per round: hf 200/100, 500/400, 800/700 -> median 1.25; grad-accum memory 30/10, 60/40, 90/70
    # -> 1.5
    assert doc["arms"]["hf-trainer"]["speed_x"] == pytest.approx(1.25)
    assert doc["arms"]["grad-accum"]["memory_x"] == pytest.approx(1.5)
    md = bench_train_report.markdown(doc)
    assert "**skipped**" in md and "1.25x" in md


def test_cpu_skips_gpu_only_arms_with_reasons():
    b = BenchTrainConfig()
    arms = {a.name: a for a in bench_arms.select_arms(b, CPU, "text")}
    for name in (
        "flash",
        "fp16",
        "tf32",
        "offload",
        "qlora",
    ):  # qlora: a preset is not a trained model
        assert bench_arms.skip_reason(arms[name], CPU, b, "text"), name
    assert "packed" in bench_arms.skip_reason(arms["padding-free"], CPU, b, "text")
    assert bench_arms.skip_reason(arms["padding-free"], CPU, b, "messages") is None
    assert bench_arms.skip_reason(arms["bf16"], CPU, b, "text") is None  # slow on CPU, but it runs
    assert bench_arms.skip_reason(arms["flash"], H100, b, "text") is None


def test_precision_arms_that_would_repeat_the_baseline_are_skipped():
    """The GPU baseline is bf16 and the CPU one fp32: the arm equal to it says so instead of running
    twice."""
    b = BenchTrainConfig()
    gpu = {a.name: a for a in bench_arms.select_arms(b, H100, "text")}
    cpu = {a.name: a for a in bench_arms.select_arms(b, CPU, "text")}
    assert "bf16 already" in bench_arms.skip_reason(gpu["bf16"], H100, b, "text")
    assert bench_arms.skip_reason(gpu["fp32"], H100, b, "text") is None
    assert bench_arms.skip_reason(gpu["fp32-tf32"], H100, b, "text") is None
    assert gpu["fp32-tf32"].overrides == {"techniques.precision": "fp32", "techniques.tf32": True}
    assert "fp32 already" in bench_arms.skip_reason(cpu["fp32"], CPU, b, "text")
    assert bench_arms.skip_reason(cpu["bf16"], CPU, b, "text") is None
    b.techniques.precision = (
        "fp32"  # an explicit fp32 baseline on the GPU: now the bf16 arm measures something
    )
    assert bench_arms.skip_reason(gpu["bf16"], H100, b, "text") is None
    # the GPU's best set leaves out bf16 when the baseline is bf16 already, and keeps the rest
    best = {a.name: a for a in bench_arms.select_arms(BenchTrainConfig(), H100)}["best"].overrides
    assert best["techniques.attention"] == "flash" and best["techniques.compile"] == "default"


@pytest.mark.parametrize(
    "micro, accum, cap, expected",
    [
        (4, 4, 0, (16, 1)),
        (4, 4, 8, (8, 2)),
        (4, 2, 8, (8, 1)),
        (4, 3, 8, (6, 2)),
        (8, 2, 32, (16, 1)),
    ],
)
def test_batch_size_arm_respects_the_micro_batch_cap(micro, accum, cap, expected):
    """16 x 2048 tokens at ~1B cannot fit 80 GB: under bench.max_micro_batch the arm takes the
    largest divisor of the effective batch that fits, and keeps the effective batch."""
    b = bench_config(
        training__micro_batch_size=micro, training__grad_accum=accum, bench__max_micro_batch=cap
    )
    arm = {a.name: a for a in bench_arms.all_arms(b)}["batch-size"]
    got = (arm.overrides["training.micro_batch_size"], arm.overrides["training.grad_accum"])
    assert got == expected and got[0] * got[1] == micro * accum


def test_best_arm_merges_methods_and_leaves_out_unavailable_ones():
    b = bench_config(bench__best="batch-size,flash,adamw-fused")
    best = {a.name: a for a in bench_arms.select_arms(b, CPU)}["best"].overrides
    assert best == {
        "training.micro_batch_size": 16,
        "training.grad_accum": 1,
        "techniques.optimizer": "adamw-fused",
    }
    gpu_best = {a.name: a for a in bench_arms.select_arms(b, H100)}["best"].overrides
    assert gpu_best["techniques.attention"] == "flash"


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(bench__arms="baseline,flsh"), "bench.arms: unknown arm 'flsh'"),
        (dict(bench__best="chekpointing"), "bench.best: unknown arm"),
        (dict(training__max_steps=2, bench__warmup_steps=2), "training.max_steps (2) must exceed"),
        (dict(bench__reps=0), "bench.reps must be"),
        (dict(bench__max_micro_batch=-1), "bench.max_micro_batch must be"),
        (dict(data__seq_len=0), "data.seq_len must be"),
    ],
)
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")) as err:
        bench_train.validate(bench_config(**kw))
    assert err.value.hint


def test_cli_reports_unknown_arm_without_traceback(capsys):
    from onegpu.cli.main import main

    assert main(["bench", "train", "--bench.arms", "baseline,flsh"]) == 2
    err = capsys.readouterr().err
    assert "unknown arm 'flsh'" in err and "did you mean 'flash'" in err


def test_timing_drops_the_warmup_window():
    records = [
        {
            "step": 2,
            "tokens_seen": 200,
            "tokens_per_s": 1.0,
            "loss": 5.0,
        },  # warm-up (+ step-0 eval)
        {"step": 4, "tokens_seen": 400, "tokens_per_s": 100.0, "loss": 4.0},
        {"step": 5, "tokens_seen": 500, "tokens_per_s": 50.0, "loss": 3.5},
    ]
    t = timing_from_windows(records, warmup=2)
    assert t == {
        "timed_steps": 3,
        "timed_tokens": 300,
        "timed_seconds": pytest.approx(4.0),
        "startup_s": pytest.approx(200 - 2 * 4.0 / 3),  # 2 untimed steps in 200 s, then 4/3 s
        "final_loss": 3.5,
    }


def test_config_sections_are_the_run_config_with_bench_defaults():
    """The arms' settings are `onegpu train`'s own Config sections (same flags), with quick-sweep
    defaults."""
    from onegpu.cli.args import make_parser, parse
    from onegpu.config import Config

    assert isinstance(BenchTrainConfig(), Config)
    parser = make_parser("onegpu bench train", "", BenchTrainConfig)
    b, _ = parse(
        parser,
        [
            "--model.name",
            "tiny",
            "--data.seq_len",
            "128",
            "--training.micro_batch_size",
            "4",
            "--bench.reps",
            "5",
            "--techniques.optimizer",
            "adafactor",
        ],
        BenchTrainConfig,
    )
    assert (b.data.seq_len, b.training.micro_batch_size, b.bench.reps) == (128, 4, 5)
    cfg = bench_train.base_config(b, "/tmp/x")
    assert "bench" not in cfg and cfg["techniques"]["optimizer"] == "adafactor"
    assert cfg["training"]["log_every"] == b.bench.warmup_steps and cfg["output"]["dir"] == "/tmp/x"
    assert cfg["training"]["warmup_steps"] == 0 and BenchTrainConfig().training.max_steps == 10


def test_dry_run_lists_arms_and_skips_without_training(capsys, tmp_path):
    from onegpu.cli.main import main

    assert main(["bench", "train", "--bench.dry_run", "true", "--bench.out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "hf-trainer-tuned" in out and "skip: " in out
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written
