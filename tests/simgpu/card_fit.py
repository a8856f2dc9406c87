"""The training loop on the card: ``onegpu.train`` (the assembly `onegpu train` uses) for a few
steps of a tiny Llama saved with save_pretrained, its values substituted as fit_harness.py names.
Runs inside a card's process; the loop runs on the simulated H100 only (it does not branch on which
card runs it: the card's decisions are checked on every card in card_decisions.py)."""

from __future__ import annotations

import gc
import os
import sys

import cards
import fit_harness
import pytest
import torch

from onegpu.training.state import Callback

LOSS = 2.5  # what every fake scalar reads in these runs: the logged losses must be exactly it


def only_on(key: str):
    """Run on the simulated ``key`` only, skipped before any fixture is built on the others."""
    return pytest.mark.skipif(
        os.environ.get(cards.ENV_CARD) != key,
        reason=f"the loop runs on the simulated {key} (card decisions run on every card)",
    )


class Watch(Callback):
    """What the run held during its steps, read from the run itself."""

    def __init__(self):
        self.params: list[set] = []  # per step: (device type, fake?) of every parameter
        self.state: list[set] = []  # per step: devices of the optimizer's state
        self.same_params = None  # the optimizer's parameters are the model's
        self.autocast: list = []  # dtype of a projection's output in the steps' forwards
        self.logged: list[tuple[float, int]] = []  # (memory_gb logged, the card's peak bytes)
        self.micro: list[tuple[int, int]] = []  # per step: (micro_batch_size, grad_accum)

    def on_train_begin(self, run, state) -> None:
        opt = [p for g in run.optimizer.param_groups for p in g["params"]]
        self.same_params = {id(p) for p in opt} == {id(p) for p in run.model.parameters()}
        proj = run.model.model.layers[0].self_attn.q_proj
        proj.register_forward_hook(
            lambda m, i, out: self.autocast.append(out.dtype) if m.training else None
        )

    def on_step_end(self, run, state) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        self.params.append(
            {(p.device.type, isinstance(p, FakeTensor)) for p in run.model.parameters()}
        )
        inner = run.optimizer.optimizer  # Accelerate's wrapper holds the torch optimizer
        self.state.append({v.device.type for s in inner.state.values() for v in s.values()})
        self.micro.append((state.micro_batch_size, state.grad_accum))

    def on_log(self, run, state, record) -> None:
        self.logged.append((record["memory_gb"], cards.MEMORY.peak))


def config(tmp_path, model_dir, precision: str = "bf16", **training) -> dict:
    """A few steps of the tiny model in ``precision`` autocast, evaluation on, no checkpoint written
    (``training.save_every: 0``: only the final model, whose write fit_harness substitutes)."""
    from helpers import make_cfg

    cfg = make_cfg(tmp_path, model_dir, save_every=0, **training)
    cfg["techniques"] = {"precision": precision}
    return cfg


class Calls:
    """Counts the calls of ``torch.cuda.<name>`` made by the function ``caller`` of the source file
    ending in ``path`` (the code under test calls torch.cuda through the module)."""

    def __init__(self, name: str, caller: str, path: str):
        self.name, self.caller, self.path, self.count = name, caller, path, 0

    def __enter__(self):
        self._real = getattr(torch.cuda, self.name)

        def counted(*args, **kwargs):
            code = sys._getframe(1).f_code
            if code.co_name == self.caller and code.co_filename.endswith(self.path):
                self.count += 1
            return self._real(*args, **kwargs)

        setattr(torch.cuda, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(torch.cuda, self.name, self._real)


@only_on("H100")
def test_fit_runs_on_the_card(tmp_path, tiny_model_dir):
    """Four steps: the parameters were fake cuda tensors in every step (the optimizer's own, its
    state on the card too), forward ran under bf16 autocast, the metrics hold every step and every
    evaluation with the substituted loss (validation's over its real target count), the memory
    logged is the card's counted peak, the loop synchronised the host before each window's clock
    read, and no checkpoint was written."""
    import onegpu
    from onegpu.checkpoint.local import PREFIX
    from onegpu.report import read_metrics

    watch = Watch()
    with (
        Calls("synchronize", "_synchronize", "training/loop.py") as syncs,
        fit_harness.on_the_card(LOSS),
    ):
        cards.MEMORY.reset_peak()
        result = onegpu.train(config(tmp_path, tiny_model_dir, max_steps=4, eval_every=2), [watch])
    assert watch.same_params
    assert watch.params == [{("cuda", True)}] * 4
    assert watch.state == [{"cuda"}] * 4  # AdamW's step, exp_avg, exp_avg_sq
    assert watch.autocast and set(watch.autocast) == {torch.bfloat16}
    recs = read_metrics(result.run_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in recs if r["split"] == "train"] == [
        (s, LOSS) for s in (1, 2, 3, 4)
    ]
    # validation: the substituted summed loss over the real count of the validation targets
    val = [(r["step"], LOSS / r["loss"]) for r in recs if r["split"] == "val"]
    assert [s for s, _ in val] == [0, 2, 4]
    assert all(n == pytest.approx(round(n)) and round(n) > 0 for _, n in val)
    # the memory logged is the card's counted peak; after a step it holds at least the fp32
    # weights, their gradients and AdamW's two moments
    weights = sum(p.numel() * 4 for p in result_params(tiny_model_dir))
    assert len(watch.logged) == 4
    assert all(gb == peak / 2**30 and peak >= 4 * weights for gb, peak in watch.logged)
    assert syncs.count == 4  # log_every 1: one synchronisation per logged window
    assert result.state.step == 4 and not list(result.run_dir.glob(f"{PREFIX}*"))
    assert (result.final_dir / "model.safetensors").is_file()


def result_params(model_dir):
    """The saved tiny model's parameters (on the host, outside the card's mode)."""
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(str(model_dir)).parameters())


def write_pairs(path) -> str:
    """Preference pairs from the tests' corpus: the snippet's rest chosen over its lines
    reversed."""
    import json

    from helpers import CORPUS

    snippets = [c for c in dict.fromkeys(CORPUS) if "\n" in c.strip()]
    with open(path, "w") as f:
        for i in range(24):
            head, _, rest = snippets[i % len(snippets)].partition("\n")
            worse = "\n".join(reversed(rest.splitlines())) + "\n"
            f.write(json.dumps({"prompt": head + "\n", "chosen": rest, "rejected": worse}) + "\n")
    return str(path)


class ReferenceWatch(Callback):
    """Forwards of a projection of the policy (and of the reference copy, if any) in the steps:
    (whose, grad enabled, adapters disabled, device, fake, output dtype)."""

    def __init__(self, copy: bool):
        self.with_copy = copy  # the reference is a copy (preference.reference=copy)
        self.calls: list[tuple] = []
        self.copy = None  # the reference copy's parameters as (device, fake, requires_grad)
        self.shared = None  # parameters the copy shares with the policy

    def _hook(self, whose: str, module, policy):
        from peft.tuners.lora import LoraLayer
        from torch._subclasses.fake_tensor import FakeTensor

        def record(m, args, out):
            if not policy.training:  # the evaluations' forwards
                return
            off = isinstance(m, LoraLayer) and m.disable_adapters
            fake = isinstance(out, FakeTensor)
            self.calls.append(
                (whose, torch.is_grad_enabled(), off, out.device.type, fake, out.dtype)
            )

        module.register_forward_hook(record)

    def on_train_begin(self, run, state) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        self._hook("policy", _q_proj(run.model), run.model)
        if self.with_copy:
            copy = run.objective.reference.model  # reference.CopyReference's frozen model
            self._hook("copy", _q_proj(copy), run.model)
            self.copy = {
                (p.device.type, isinstance(p, FakeTensor), p.requires_grad)
                for p in copy.parameters()
            }
            mine = {id(p) for p in run.model.parameters()}
            self.shared = [n for n, p in copy.named_parameters() if id(p) in mine]


def _q_proj(model):
    """The first decoder layer's query projection (PEFT's LoRA layer when adapters are on)."""
    return next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))


@only_on("H100")
@pytest.mark.parametrize("reference", ["adapters", "copy"])
def test_dpo_reference_pass_on_the_card(tmp_path, tiny_model_dir, reference):
    """DPO through onegpu.train: each micro-batch's reference log-probs come from a no-grad forward
    on the card, of the policy with its LoRA adapters off (adapters) or of a frozen copy of the
    starting model (copy, a full fine-tune) under the run's bf16 autocast; then the policy's own
    forward with gradients."""
    import onegpu

    lora = reference == "adapters"
    cfg = config(tmp_path, tiny_model_dir, max_steps=1, grad_accum=2, objective="dpo")
    cfg["data"]["path"] = write_pairs(tmp_path / "pairs.jsonl")
    cfg["data"]["seq_len"] = 64
    cfg["preference"] = {"reference": reference}
    cfg["techniques"]["lora"] = {"enabled": lora, "r": 8}
    watch = ReferenceWatch(copy=not lora)
    with fit_harness.on_the_card(LOSS):
        result = onegpu.train(cfg, [watch])
    assert result.state.step == 1
    ref = ("policy", False, True) if lora else ("copy", False, False)
    policy = ("policy", True, False)
    whose = [c[:3] for c in watch.calls]
    # per micro-batch: the reference first, then the policy (1 step x 2 micro-batches)
    assert whose == [ref, policy] * 2
    assert {c[3:] for c in watch.calls} == {("cuda", True, torch.bfloat16)}
    if not lora:
        assert watch.copy == {("cuda", True, False)} and watch.shared == []


@only_on("T4")
def test_out_of_memory_shrinks_the_micro_batch(tmp_path, tiny_model_dir, caplog):
    """A T4 whose memory is lowered (``MEMORY.limit``, a limit override: the tiny model would need
    a batch far too large for the host to reach 15 GiB) to the peak that two steps of micro-batch
    2 x grad_accum 2 reach: micro-batch 4 x 1 fits its first step, runs out of memory in its second
    (AdamW's moments now exist), and the loop releases the failed attempt's memory (empty_cache
    included), retries the step as 2 x grad_accum 2 (the effective batch kept) and finishes.
    fp32: fp16's loss scaler would read the substituted value as an inf found (card_step checks the
    scaler)."""
    import onegpu
    from onegpu.report import read_metrics

    fits = Watch()
    gc.collect()
    held = cards.MEMORY.allocated()  # what earlier checks in this process still hold on the card
    cards.MEMORY.reset_peak()
    with fit_harness.on_the_card(LOSS):
        onegpu.train(
            config(
                tmp_path,
                tiny_model_dir,
                "fp32",
                name="fits",
                micro_batch_size=2,
                grad_accum=2,
                max_steps=2,
                eval_every=0,
            ),
            [fits],
        )
    logged, peak = fits.logged[-1]
    gc.collect()
    assert cards.MEMORY.allocated() == held  # the first run gave all of its memory back
    assert held == sum(cards.MEMORY.live.values())  # the running count is the live storages' sum
    watch = Watch()
    cards.MEMORY.limit = peak
    try:
        with (
            Calls("empty_cache", "release_memory", "training/recovery.py") as released,
            fit_harness.on_the_card(LOSS),
        ):
            result = onegpu.train(
                config(
                    tmp_path,
                    tiny_model_dir,
                    "fp32",
                    name="oom",
                    micro_batch_size=4,
                    grad_accum=1,
                    max_steps=2,
                    eval_every=0,
                ),
                [watch],
            )
    finally:
        cards.MEMORY.limit = None
    assert watch.micro == [(4, 1), (2, 2)]  # halved, accumulation doubled: 4 sequences a step
    assert result.state.step == 2 and result.state.tokens_seen == 2 * 4 * 32
    assert released.count == 1
    assert "step 2: out of memory with micro_batch_size 4; retrying with 2 x grad_accum 2" in (
        caplog.text
    )
    recs = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs if r["split"] == "train"] == [1, 2]
    assert logged == peak / 2**30 and cards.MEMORY.peak <= peak
    # the error itself is the one a card raises
    with cards.fake_cuda():
        cards.MEMORY.limit = cards.MEMORY.allocated() + 1024
        try:
            with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to "):
                torch.empty(4096, device="cuda")
        finally:
            cards.MEMORY.limit = None


@only_on("H100")
def test_probe_reports_the_cards_peak(tmp_path, tiny_model_dir):
    """The planner's probe (plan/probe.probe_one: `train --plan auto` measures its best setups with
    it) on the card: the setup the planner ranks first runs its warm-up and measured steps, the
    peak it reports is the card's counted peak since the probe reset it, and it synchronises before
    its clock and gives the card's cache back after."""
    from helpers import make_cfg
    from onegpu import hardware, models
    from onegpu.config import from_dict
    from onegpu.plan import probe
    from onegpu.plan.arch import model_shape
    from onegpu.plan.search import search
    from onegpu.techniques.attention import planning_attention
    from onegpu.training.data import build_data

    cfg = from_dict(make_cfg(tmp_path, tiny_model_dir, micro_batch_size=2, grad_accum=1))
    cfg.techniques.compile = "off"  # torch.compile under fake cuda is outside the tier
    device = hardware.detect()
    name = models.resolve_name(cfg.model, device.is_gpu)
    shape = model_shape(name, cfg.model.vocab_size, cfg.model.trust_remote_code)
    attention = planning_attention(cfg.techniques, shape.config, cfg.model.trust_remote_code)
    gib = device.total_memory / 2**30
    plan = search(cfg, probe._device_spec(device), shape, cfg.data.seq_len, 2, gib, attention)
    # on a GPU the planner also offers checkpointing with the layer inputs in pinned host memory
    assert any(r.candidate.techniques.checkpointing == "offload" for r in plan.rows)
    row = plan.best
    assert row is not None and row.candidate.techniques.precision in ("bf16", "bf16-pure")
    shared = build_data(cfg, name)
    cards.MEMORY.peak = 1 << 50  # a stale peak the probe must reset
    with (
        Calls("synchronize", "_sync", "plan/probe.py") as syncs,
        Calls("empty_cache", "_release", "plan/probe.py") as released,
        fit_harness.on_the_card(LOSS),
    ):
        measured = probe.probe_one(row, cfg, shared, device)
    assert measured.error == "" and measured.tokens_per_s > 0
    assert measured.peak_gb == cards.MEMORY.peak / 2**30
    weights = sum(p.numel() for p in result_params(tiny_model_dir)) * 2  # at least bf16 weights
    assert weights < cards.MEMORY.peak < 1 << 30
    assert syncs.count == 1 and released.count == 1


@only_on("H100")
def test_offload_optimizer_falls_back_through_the_assembly(tmp_path, monkeypatch, caplog):
    """ZeRO CPU offload on the card: the assembly builds DeepSpeed's CPU Adam (a C++ op compiled on
    first use); where that build fails (here a compiler that always fails, ``CXX=/bin/false``) the
    run gets torch's AdamW over the model's parameters, with a warning, instead of stopping."""
    import logging

    from card_step import _model

    from onegpu.config import Config
    from onegpu.hardware import detect
    from onegpu.training import assemble

    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # no cached build
    cfg = Config()
    cfg.techniques.offload = "zero2-cpu"
    t = cfg.training  # settled, as a run settles them before assembling (hyper.py)
    t.lr, t.weight_decay, t.warmup_steps = 1e-4, 0.0, 0
    model = _model()
    with caplog.at_level(logging.WARNING), cards.fake_cuda():
        cards.on_card(model)
        optimizer, _ = assemble.build_optimizer(cfg, detect(), model)
    assert type(optimizer) is torch.optim.AdamW
    trained = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(trained) == sorted(id(p) for p in model.parameters())
    assert "DeepSpeed CPU Adam failed to build" in caplog.text
