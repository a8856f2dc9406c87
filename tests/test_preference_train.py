"""Preference tuning end to end: DPO with LoRA (adapters-off reference) and full DPO (precomputed
reference) from the command line with a rising reward accuracy, ORPO/SimPO runs, accumulation
normalised by pairs, an out-of-memory retry that keeps the effective batch, bitwise resume, and bad
pair data."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from helpers import CORPUS
from onegpu import train
from onegpu.errors import DataError
from onegpu.objectives.tokens import IGNORE
from onegpu.report import read_metrics
from onegpu.training import assemble
from onegpu.training.state import Callback

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded


def _shuffled(text: str, rng: random.Random) -> str:
    words = text.split()
    while len(words) > 1:
        rng.shuffle(words)
        if " ".join(words) != " ".join(text.split()):
            break
    return " ".join(words) + "\n"


def write_pairs(path, n: int = 48, chat: bool = False):
    rng = random.Random(0)
    snippets = [c for c in dict.fromkeys(CORPUS) if "\n" in c.strip()]
    with open(path, "w") as f:
        for i in range(n):
            head, _, rest = snippets[i % len(snippets)].partition("\n")
            rec = {"prompt": head + "\n", "chosen": rest, "rejected": _shuffled(rest, rng)}
            if chat:
                rec = {
                    "prompt": [{"role": "user", "content": head}],
                    "chosen": [{"role": "assistant", "content": rest}],
                    "rejected": [{"role": "assistant", "content": rec["rejected"]}],
                }
            f.write(json.dumps(rec) + "\n")
    return path


def cfg_for(tmp_path, model_dir, objective="dpo", name="run", lora=False, **training):
    data = tmp_path / "pairs.jsonl"
    if not data.exists():
        write_pairs(data)
    t = dict(
        objective=objective,
        micro_batch_size=4,
        grad_accum=1,
        max_steps=16,
        eval_every=8,
        eval_batches=2,
        log_every=4,
        lr=3e-3 if lora else 1e-3,
        warmup_steps=0,
        seed=3,
    )
    t.update(training)
    return {
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "seq_len": 64, "num_proc": 1, "val_fraction": 0.15},
        "training": t,
        "techniques": {"lora": {"enabled": lora, "r": 8}, "compile": "off"},
        "output": {
            "dir": str(tmp_path / "runs"),
            "name": name,
            "report_to": "none",
            "keep_last": 10,
        },
    }


def train_records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"]


def _assert_learns(result):
    recs = train_records(result.run_dir)
    assert all(
        {"reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected"} <= r.keys()
        for r in recs
    )
    first, last = recs[0], recs[-1]
    assert last["reward_margin"] > first["reward_margin"] and last["reward_margin"] > 0
    assert last["reward_accuracy"] >= max(first["reward_accuracy"], 0.75)
    assert last["loss"] < first["loss"]


def test_dpo_with_lora_from_the_cli_raises_the_reward_accuracy(tmp_path, tiny_model_dir, capsys):
    from onegpu.cli.main import main

    write_pairs(tmp_path / "pairs.jsonl")
    run = tmp_path / "runs" / "cli"
    code = main(
        [
            "train",
            "--model.name",
            str(tiny_model_dir),
            "--data.path",
            str(tmp_path / "pairs.jsonl"),
            "--data.seq_len",
            "64",
            "--data.num_proc",
            "1",
            "--training.objective",
            "dpo",
            "--techniques.lora.enabled",
            "true",
            "--techniques.lora.r",
            "8",
            "--training.lr",
            "3e-3",
            "--training.micro_batch_size",
            "4",
            "--training.max_steps",
            "16",
            "--training.log_every",
            "4",
            "--training.warmup_steps",
            "0",
            "--training.eval_every",
            "8",
            "--techniques.compile",
            "off",
            "--output.dir",
            str(tmp_path / "runs"),
            "--output.name",
            "cli",
            "--output.report_to",
            "none",
        ]
    )
    assert code == 0
    recs = train_records(run)
    assert (
        recs[-1]["reward_accuracy"] > recs[0]["reward_accuracy"]
        or recs[-1]["reward_accuracy"] == 1.0
    )
    assert recs[-1]["reward_margin"] > recs[0]["reward_margin"] > -1e-6
    assert not (
        run / "reference_logps.safetensors"
    ).exists()  # the reference is the base: adapters off
    assert (run / "final" / "adapter_config.json").is_file()
    val = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "val"]
    assert val[0]["loss"] == pytest.approx(
        0.6931, abs=1e-3
    )  # policy == reference before the first step


def test_full_dpo_with_precomputed_reference_learns_and_keeps_the_reference(
    tmp_path, tiny_model_dir
):
    result = train(cfg_for(tmp_path, tiny_model_dir))
    _assert_learns(result)
    from safetensors.torch import load_file

    saved = load_file(str(result.run_dir / "reference_logps.safetensors"))
    assert set(saved) == {
        "train.ref_chosen_logps",
        "train.ref_rejected_logps",
        "validation.ref_chosen_logps",
        "validation.ref_rejected_logps",
    }
    assert all(torch.isfinite(v).all() and (v < 0).all() for v in saved.values())


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_reference_free_objectives_learn(tmp_path, tiny_model_dir, objective):
    result = train(cfg_for(tmp_path, tiny_model_dir, objective, lr=2e-3))
    _assert_learns(result)
    assert not (result.run_dir / "reference_logps.safetensors").exists()


class _RunData(Callback):
    """Keeps the run's data (tokenized splits and collator) as the loop receives it."""

    def on_train_begin(self, run, state):
        self.data = run.data


def test_dpo_on_chat_pairs_trains_on_the_responses(tmp_path, tiny_model_dir, tiny_tokenizer):
    """Chat pairs through the tokenizer's chat template: every sequence the loop trains on is the
    whole conversation, its unlabelled part exactly the user's turn with the assistant header, its
    targets exactly the reply (chosen in the first half of a batch, rejected in the second) and the
    turn's end; and the run steps."""
    write_pairs(tmp_path / "pairs.jsonl", chat=True)
    seen = _RunData()
    result = train(cfg_for(tmp_path, tiny_model_dir, max_steps=2, eval_every=0), callbacks=[seen])
    assert result.state.step == 2 and result.run_dir.joinpath("final").is_dir()
    records = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    render = tiny_tokenizer.apply_chat_template
    expected = set()  # (prompt, whole chosen conversation, whole rejected one) of each record
    for r in records:
        prompt = render(r["prompt"], tokenize=False, add_generation_prompt=True)
        whole = [render(r["prompt"] + r[k], tokenize=False) for k in ("chosen", "rejected")]
        expected.add((prompt, *whole))
    data = seen.data
    pairs = len(data.train_ds)
    batch = data.collator([data.train_ds[i] for i in range(pairs)])
    text = tiny_tokenizer.decode
    for i in range(pairs):
        rows = []
        for row in (i, pairs + i):  # the pair's chosen and rejected sequences
            ids, labels = batch["input_ids"][row], batch["labels"][row]
            real = batch["attention_mask"][row].bool()
            prompt, target = ids[real & (labels == IGNORE)], ids[real & (labels != IGNORE)]
            rows.append((text(prompt.tolist()), text(ids[real].tolist()), text(target.tolist())))
        (prompt, chosen, chosen_target), (prompt_r, rejected, rejected_target) = rows
        assert prompt == prompt_r and (prompt, chosen, rejected) in expected
        assert chosen_target == chosen[len(prompt) :] and rejected_target == rejected[len(prompt) :]


def test_accumulation_and_oom_retry_keep_the_pair_batch(tmp_path, tiny_model_dir, monkeypatch):
    """4 pairs x 1, 2 pairs x 2 and 4 pairs x 1 that runs out of memory above 2 pairs (retried as 2
    x 2) train the same: the loss is a mean over the pairs of the whole accumulated batch."""
    whole = train(
        cfg_for(tmp_path, tiny_model_dir, name="whole", max_steps=4, eval_every=0, log_every=1)
    )
    accum = train(
        cfg_for(
            tmp_path,
            tiny_model_dir,
            name="accum",
            max_steps=4,
            eval_every=0,
            log_every=1,
            micro_batch_size=2,
            grad_accum=2,
        )
    )

    real = assemble.make_objective

    class OomAbove2:
        def __init__(self, fn):
            self.fn = fn

        def __getattr__(self, name):
            return getattr(self.fn, name)

        def loss(self, model, batch):
            if model.training and self.fn.count(batch) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return self.fn.loss(model, batch)

    monkeypatch.setattr(assemble, "make_objective", lambda *a: OomAbove2(real(*a)))
    retried = train(
        cfg_for(tmp_path, tiny_model_dir, name="oom", max_steps=4, eval_every=0, log_every=1)
    )
    assert (retried.state.micro_batch_size, retried.state.grad_accum) == (2, 2)
    base = [r[k] for r in train_records(whole.run_dir) for k in ("loss", "reward_margin")]
    assert base[-2] < base[0]  # it trained
    for other in (accum, retried):
        got = [r[k] for r in train_records(other.run_dir) for k in ("loss", "reward_margin")]
        assert got == pytest.approx(base, rel=1e-4, abs=1e-6)


def test_dpo_resume_is_bitwise_and_reads_the_saved_reference(tmp_path, tiny_model_dir):
    from helpers import assert_same_weights

    cfg = cfg_for(tmp_path, tiny_model_dir, max_steps=6, eval_every=3, log_every=1, save_every=3)
    first = train(cfg)
    straight = [
        (r["split"], r["step"], r["loss"]) for r in read_metrics(first.run_dir / "metrics.jsonl")
    ]
    import shutil

    shutil.copytree(first.run_dir / "final", tmp_path / "final-straight")
    cfg["output"]["resume"] = str(first.run_dir / "checkpoint-00000003")
    second = train(cfg)
    resumed = [
        (r["split"], r["step"], r["loss"]) for r in read_metrics(second.run_dir / "metrics.jsonl")
    ]
    assert resumed == straight
    assert_same_weights(tmp_path / "final-straight", second.run_dir / "final")


def test_resume_without_the_saved_reference_is_one_clear_error(tmp_path, tiny_model_dir):
    cfg = cfg_for(tmp_path, tiny_model_dir, max_steps=2, eval_every=0, save_every=1)
    first = train(cfg)
    (first.run_dir / "reference_logps.safetensors").unlink()
    cfg["output"]["resume"] = "latest"
    with pytest.raises(DataError, match="reference_logps.safetensors is missing"):
        train(cfg)


@pytest.mark.parametrize(
    "record, match",
    [
        ({"prompt": "a", "chosen": 3, "rejected": "b"}, r"pairs.jsonl:2: 'chosen' must be text"),
        (
            {"prompt": "a", "chosen": [{"role": "bot", "content": "x"}], "rejected": "b"},
            r"pairs.jsonl:2, 'chosen'",
        ),
    ],
)
def test_bad_pair_records_name_the_record(tmp_path, tiny_model_dir, record, match):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "def f():\n", "chosen": "    return 1\n", "rejected": "return f 1\n"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n" + json.dumps(good) * 0)
    cfg = cfg_for(tmp_path, tiny_model_dir, max_steps=1)
    cfg["data"]["val_fraction"] = 0
    with pytest.raises(DataError, match=match):
        train(cfg)
    assert not (tmp_path / "runs" / "run").exists()


def test_sft_on_pair_data_and_dpo_on_text_are_clear_errors(tmp_path, tiny_model_dir, text_file):
    write_pairs(tmp_path / "pairs.jsonl")
    cfg = cfg_for(tmp_path, tiny_model_dir, objective="sft")
    with pytest.raises(DataError, match=re.escape("set --training.objective dpo")):
        train(cfg)
    cfg = cfg_for(tmp_path, tiny_model_dir)
    cfg["data"]["path"] = str(text_file)
    with pytest.raises(DataError, match="needs preference pairs"):
        train(cfg)


class _Evidence(Callback):
    """What a method did to the run, read from the model and optimizer the loop trains (hooks on
    them; nothing the run reports about itself): decoder-layer forwards with gradients, and those
    run again inside backward (checkpointing's recompute); graphs dynamo compiled; the dtype an MLP
    projection computes in; the inputs the model's forward receives; the 4-bit layers; each
    parameter's optimizer state."""

    def __init__(self):
        self.forwards = self.recomputed = 0
        self.dtypes, self.inputs = set(), set()

    def on_train_begin(self, run, state):
        from torch._dynamo.utils import counters

        from onegpu.techniques.checkpointing import decoder_layers

        self.graphs = counters["stats"]["unique_graphs"]
        model = run.model
        self.four_bit = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
        self.trained = [n for n, p in model.named_parameters() if p.requires_grad]
        compiled = any(m._compiled_call_impl is not None for m in model.modules())
        if compiled:  # a hook inside a compiled block would change the graph it counts
            return
        for layer in decoder_layers(model):  # its first module: the recompute calls the layer's
            layer.input_layernorm.register_forward_pre_hook(self._layer)  # forward, not the layer
        up = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.up_proj"))
        up.register_forward_hook(lambda m, args, out: self.dtypes.add(out.dtype))
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)

    def _layer(self, module, args):
        if torch.is_grad_enabled():
            inside_backward = torch._C._current_graph_task_id() != -1
            self.recomputed += inside_backward
            self.forwards += not inside_backward

    def _inputs(self, module, args, kwargs):
        given = frozenset(k for k, v in kwargs.items() if torch.is_tensor(v))
        self.inputs.add((given, kwargs["input_ids"].shape[0]))

    def on_train_end(self, run, state):
        from torch._dynamo.utils import counters

        self.graphs = counters["stats"]["unique_graphs"] - self.graphs
        opt = getattr(run.optimizer, "optimizer", run.optimizer)
        self.state = [(p.numel(), s) for p, s in opt.state.items()]


def _is_active(method: str, seen: _Evidence) -> bool:
    """Whether the run shows ``method`` at work."""
    if method == "checkpointing":  # every layer forward that saves for backward runs again in it
        return seen.recomputed == seen.forwards > 0
    if method == "compile":
        return seen.graphs > 0
    if method == "bf16":
        return seen.dtypes == {torch.bfloat16}
    if method == "adamw-8bit":  # bitsandbytes quantizes the state of tensors of 4,096+ values
        big = [s for n, s in seen.state if n >= 4096]
        codes = [(s.get("state1"), s.get("state2")) for s in big]
        return bool(big) and all(
            a is not None and a.dtype == b.dtype == torch.uint8 for a, b in codes
        )
    if method == "padding-free":  # one packed row, documents told apart by position ids
        return all(
            "position_ids" in k and "attention_mask" not in k and n == 1 for k, n in seen.inputs
        )
    if method == "qlora":
        return (
            bool(seen.four_bit)
            and all(m.weight.dtype == torch.uint8 for m in seen.four_bit)
            and all("lora_" in n for n in seen.trained)
        )
    raise AssertionError(method)


@pytest.mark.parametrize(
    "techniques, tol",
    [
        ({"checkpointing": "full"}, 1e-5),
        # inductor compiles the policy: 23 CPU s from a cold cache, so in the slow tier
        pytest.param({"compile": "default"}, 1e-4, marks=pytest.mark.slow),
        ({"precision": "bf16"}, None),
        ({"optimizer": "adamw-8bit"}, None),
        ({"padding_free": True}, 1e-4),
        ({"lora": {"enabled": True, "r": 8, "quantize_base": "nf4"}}, None),
    ],
    ids=["checkpointing", "compile", "bf16", "adamw-8bit", "padding-free", "qlora"],
)
def test_dpo_runs_with_each_method(request, tmp_path, tiny_model_dir, techniques, tol):
    """Each method is at work in the DPO run (and not in the plain one beside it); checkpointing,
    compile and padding-free leave the math as it was; bf16 autocast, an 8-bit optimizer and QLoRA
    train."""
    if techniques.get("optimizer") == "adamw-8bit" or "lora" in techniques:
        pytest.importorskip("bitsandbytes")
    method = request.node.callspec.id
    plain, used = _Evidence(), _Evidence()
    base = train(
        cfg_for(tmp_path, tiny_model_dir, name="base", max_steps=6, eval_every=0, log_every=1),
        callbacks=[plain],
    )
    cfg = cfg_for(tmp_path, tiny_model_dir, name="method", max_steps=6, eval_every=0, log_every=1)
    cfg["techniques"].update(techniques)
    other = train(cfg, callbacks=[used])
    assert _is_active(method, used) and not _is_active(method, plain), method
    a = [r[k] for r in train_records(base.run_dir) for k in ("loss", "reward_margin")]
    b = [r[k] for r in train_records(other.run_dir) for k in ("loss", "reward_margin")]
    if tol is not None:
        assert b == pytest.approx(a, rel=tol, abs=tol)
    else:
        assert all(map(lambda x: x == x, b)) and b[-1] > 0 and b[-2] < b[0]
