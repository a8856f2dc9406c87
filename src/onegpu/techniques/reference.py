"""DPO's reference model, at the least memory each setup allows (preference.reference):

- adapters: with LoRA the reference is the base model, i.e. the policy with its adapters switched
  off (LoRA starts as the identity), so it costs one no-grad forward per micro-batch and no copy;
- precomputed: the reference log-probs of every training and validation pair, computed in one
  no-grad pass before the first step and carried in the batches: no copy and no extra forward
  during training. Kept in the run directory (reference_logps.safetensors), so a resumed run uses
  the same numbers instead of recomputing them from weights that have since been trained;
- copy: a frozen copy of the starting model in memory, for setups where neither fits.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from onegpu.data.pairs import REF_CHOSEN, REF_REJECTED
from onegpu.errors import DataError

log = logging.getLogger(__name__)
FILE = "reference_logps.safetensors"


def choose(objective: str, reference: str, lora: bool) -> str | None:
    """The reference this run uses: None (ORPO, SimPO), adapters, precomputed or copy."""
    if objective != "dpo":
        return None
    if reference == "auto":
        return "adapters" if lora else "precomputed"
    return reference


class AdapterReference:
    """Reference log-probs from the policy with its LoRA adapters disabled."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def __call__(self, model, batch: dict) -> torch.Tensor:
        from onegpu.techniques.preference import sequence_logps

        with torch.no_grad(), _peft_model(model).disable_adapter():
            return sequence_logps(model, batch, self.chunk_size)[1]


class CopyReference:
    """Reference log-probs from a frozen copy of the starting model, under the run's autocast."""

    def __init__(self, model, autocast, chunk_size: int):
        self.model, self.autocast, self.chunk_size = model, autocast, chunk_size
        self.model.eval().requires_grad_(False)

    def __call__(self, _policy, batch: dict) -> torch.Tensor:
        from onegpu.techniques.preference import sequence_logps

        with torch.no_grad(), self.autocast():
            return sequence_logps(self.model, batch, self.chunk_size)[1]


class FixedReference:
    """Zero reference log-probs, for the planner's probes of a precomputed-reference setup: they time the
    step, to which precomputed log-probs add nothing, whatever their values."""

    def __call__(self, _policy, batch: dict) -> torch.Tensor:
        from onegpu.data.pairs import PAIR_INDEX

        return torch.zeros(2 * batch[PAIR_INDEX].numel(), device=batch[PAIR_INDEX].device)


def _peft_model(model):
    inner = getattr(model, "module", model)  # DistributedDataParallel
    if not hasattr(inner, "disable_adapter"):
        raise TypeError("preference.reference=adapters needs a PEFT (LoRA) model")
    return inner


# ----------------------------------------------------------------------------------- precomputed
def precompute(run, accelerator, resumed: bool) -> None:
    """Add the reference log-probs of every pair to run.train_ds / run.val_ds as two columns.

    A resumed run reads them from its run directory; a fresh run computes them with the model as it
    is now (its starting weights) and writes them there.
    """
    path = Path(run.dir) / FILE
    splits = {"train": run.train_ds, "validation": run.val_ds}
    if resumed:
        if not path.is_file():
            raise DataError(f"{path} is missing: a resumed DPO run needs the reference log-probs computed from its "
                            "starting weights.", hint="restore the file, or start the run again with "
                            "--output.overwrite true")
        saved = _load(path)
    else:
        t0 = time.perf_counter()
        saved = {f"{name}.{col}": v for name, ds in splits.items() if ds is not None
                 for col, v in zip((REF_CHOSEN, REF_REJECTED), compute(run, ds, accelerator.device))}
        run.reference_seconds = time.perf_counter() - t0  # reported; a benchmark charges it to the run
        if accelerator.is_main_process:
            _save(path, saved)
        log.info("reference log-probs: %d pairs in %.1fs (%s)", sum(len(v) for k, v in saved.items()
                 if k.endswith(REF_CHOSEN)), run.reference_seconds, path.name)
    for name, ds in splits.items():
        if ds is None:
            continue
        chosen, rejected = saved.get(f"{name}.{REF_CHOSEN}"), saved.get(f"{name}.{REF_REJECTED}")
        if chosen is None or len(chosen) != len(ds):
            raise DataError(f"{path}: its {name} reference log-probs do not match the data ({len(ds)} pairs).",
                            hint="the data changed since the run began: start it again with --output.overwrite true")
        ds = ds.add_column(REF_CHOSEN, chosen.tolist()).add_column(REF_REJECTED, rejected.tolist())
        setattr(run, "train_ds" if name == "train" else "val_ds", ds)


@torch.no_grad()
def compute(run, ds, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probs of every pair of ``ds`` under run.model as it is now. The
    model is the prepared one: it runs under the run's autocast by itself."""
    from onegpu.data.batches import eval_batches
    from onegpu.techniques.loss import with_target_positions
    from onegpu.techniques.preference import sequence_logps

    model, chunk = run.model, run.loss_fn.chunk_size
    chosen, rejected = [], []
    was_training = model.training
    model.eval()
    try:
        # compiled blocks run eagerly: one pass does not repay compiling their no-grad variant
        with torch.compiler.set_stance("force_eager"):
            for batch in eval_batches(ds, run.cfg.training.micro_batch_size, run.collator):
                batch = {k: v.to(device) for k, v in with_target_positions(batch).items()}
                sums = sequence_logps(model, batch, chunk)[1].float().cpu()
                n = sums.numel() // 2
                chosen.append(sums[:n])
                rejected.append(sums[n:])
    finally:
        model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


def _save(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))
