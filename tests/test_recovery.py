"""Non-finite steps are skipped (and end the run after K in a row); out-of-memory halves the
micro-batch, doubles accumulation and gives the same math as the smaller micro-batch from the start.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import assert_same_weights, losses, make_cfg, make_tiny_llama, nan_at, oom_above
from onegpu import train
from onegpu.training import assemble, recovery
from onegpu.training.step import train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded


def test_smaller_micro_batch_keeps_the_effective_batch():
    assert recovery.smaller_micro_batch(8, 1) == (4, 2)
    assert recovery.smaller_micro_batch(6, 3) == (3, 6)
    assert recovery.smaller_micro_batch(3, 2) == (1, 6)
    with pytest.raises(recovery.OnegpuError, match="micro_batch_size 1"):
        recovery.smaller_micro_batch(1, 4)


def test_convert_position_points_at_the_same_examples():
    from onegpu.data.batches import BatchOrder

    n, seed = 23, 5
    big = iter(BatchOrder(n, 4, seed))
    seen = [next(big) for _ in range(7)]  # crosses an epoch boundary (5 batches of 4 per epoch)
    pos = recovery.convert_position(7, n, 4, 2)
    small = iter(BatchOrder(n, 2, seed, start=pos))
    nxt = next(big)
    assert next(small) + next(small) == nxt
    assert len(seen) == 7


def test_oom_retry_equals_smaller_micro_batch_from_the_start(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    ref = train(
        make_cfg(
            tmp_path, tiny_model_dir, name="small", micro_batch_size=2, grad_accum=2, eval_every=0
        )
    )
    monkeypatch.setattr(assemble, "make_objective", oom_above(2, assemble.make_objective))
    with caplog.at_level(logging.WARNING, logger="onegpu"):
        got = train(
            make_cfg(
                tmp_path, tiny_model_dir, name="oom", micro_batch_size=4, grad_accum=1, eval_every=0
            )
        )
    assert "out of memory with micro_batch_size 4; retrying with 2 x grad_accum 2" in caplog.text
    assert (got.state.micro_batch_size, got.state.grad_accum) == (2, 2)
    train_losses = lambda r: [x for x in losses(r.run_dir) if x[0] == "train"]  # noqa: E731
    assert train_losses(got) == train_losses(ref) and len(train_losses(ref)) == 6
    assert_same_weights(ref.run_dir / "final", got.run_dir / "final")


def test_oom_retry_off_raises(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(assemble, "make_objective", oom_above(2, assemble.make_objective))
    with pytest.raises(torch.OutOfMemoryError):
        train(make_cfg(tmp_path, tiny_model_dir, micro_batch_size=4, grad_accum=1, oom_retry=False))


def _one_step(tiny_tokenizer, loss_value: float, guard):
    from accelerate import Accelerator

    model = make_tiny_llama(tiny_tokenizer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(5, 100, (2, 16))
    micro = [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}]

    from onegpu.objectives.sft import SFT

    class Scaled(SFT):  # a loss of the value the test asks for
        def loss(self, m, b):
            return m(input_ids=b["input_ids"]).logits.float().sum() * loss_value

    train_step(
        model,
        opt,
        micro,
        Accelerator(cpu=True),
        max_grad_norm=0.0,
        objective=Scaled(),
        guard=guard,
        step=1,
    )
    changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    return changed


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_step_changes_no_weight(tiny_tokenizer, bad):
    guard = recovery.NanGuard(max_bad_steps=5)
    assert not _one_step(tiny_tokenizer, bad, guard)
    assert guard.last_bad and guard.bad_streak == 1 and guard.skipped == 1
    assert _one_step(tiny_tokenizer, 1e-3, guard)  # a finite step updates and resets the streak
    assert guard.bad_streak == 0


def test_isolated_nan_steps_are_skipped_and_logged(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(
        assemble, "make_objective", nan_at({2, 4}, assemble.make_objective, grad_accum=2)
    )
    r = train(make_cfg(tmp_path, tiny_model_dir, eval_every=0))
    recs = losses(r.run_dir)
    assert [x[1] for x in recs if x[3]] == [2, 4]
    assert all(
        x[2] == x[2] for x in recs if x[0] == "train" and x[2] is not None
    )  # no NaN in the log
    assert r.state.step == 6 and r.state.skipped_steps == 2


def test_nan_streak_stops_with_a_clear_error(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from onegpu.cli.main import main

    monkeypatch.setattr(
        assemble,
        "make_objective",
        nan_at(set(range(2, 100)), assemble.make_objective, grad_accum=1),
    )
    cfg = make_cfg(
        tmp_path, tiny_model_dir, max_steps=10, grad_accum=1, max_bad_steps=3, save_every=0
    )
    args = [
        "train",
        "--model.name",
        cfg["model"]["name"],
        "--data.path",
        cfg["data"]["path"],
        "--data.seq_len",
        "32",
        "--data.num_proc",
        "1",
        "--training.micro_batch_size",
        "2",
        "--training.max_steps",
        "10",
        "--training.max_bad_steps",
        "3",
        "--training.eval_every",
        "0",
        "--output.dir",
        str(tmp_path / "runs"),
        "--output.name",
        "nan",
        "--output.report_to",
        "none",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "NaN/inf for 3 steps in a row (last at step 4)" in err and "training.lr" in err
    assert "Traceback" not in err


def test_guard_costs_one_host_sync_per_step(tiny_tokenizer, monkeypatch):
    """The guard folds loss and gradient-norm checks into one boolean: one device->host read."""
    from accelerate import Accelerator

    model = make_tiny_llama(tiny_tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(5, 100, (2, 16))
    micro = [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}] * 2
    acc = Accelerator(cpu=True)
    from onegpu.objectives.sft import SFT

    train_step(model, opt, micro, acc, 1.0, SFT())  # warm-up, unguarded
    reads = {"n": 0}
    for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            reads["n"] += self.numel() == 1 and self.dim() == 0
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def scalar_reads(**kw) -> int:
        before = reads["n"]
        train_step(model, opt, micro, acc, 1.0, SFT(), **kw)
        return reads["n"] - before

    unguarded = scalar_reads()  # the token counts of the (host-side) batches
    assert scalar_reads(guard=recovery.NanGuard(5), step=2) == unguarded + 1
