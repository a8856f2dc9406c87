"""DPO's and KTO's reference model, at the least memory each setup allows (preference.reference):

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

from onegpu.data import unpaired
from onegpu.errors import DataError
from onegpu.objectives.tokens import TokenLoss

log = logging.getLogger(__name__)
FILE = "reference_logps.safetensors"


def choose(objective: str, reference: str, lora: bool) -> str | None:
    """The reference this run uses: None (ORPO, SimPO), adapters, precomputed or copy."""
    if objective not in ("dpo", "kto"):
        return None
    if reference == "auto":
        return "adapters" if lora else "precomputed"
    return reference


def kind_of(cfg) -> str | None:
    """The reference of any objective: ``choose`` for the preference ones; for GRPO none at
    beta = 0, else adapters with LoRA or a copy (grpo.reference)."""
    if cfg.training.objective != "grpo":
        return choose(cfg.training.objective, cfg.preference.reference, cfg.techniques.lora.enabled)
    return grpo_reference(cfg.grpo, cfg.techniques.lora.enabled)


def grpo_reference(g, lora: bool) -> str | None:
    """GRPO's reference from its section: none at beta 0, else grpo.reference (auto: adapters with
    LoRA, a copy without)."""
    if not g.beta:
        return None
    if g.reference == "auto":
        return "adapters" if lora else "copy"
    return g.reference


def build(kind: str | None, tokens: TokenLoss, model=None, autocast=None, probe: bool = False):
    """The ``(policy, batch) -> reference log-probs`` callable for ``choose``'s answer; None where
    there is none to call (ORPO, SimPO, or precomputed log-probs carried by the batches). ``tokens``
    is the objective's own, so a fallback from the fused head happens once for both."""
    if kind == "adapters":
        return AdapterReference(tokens)
    if kind == "copy":
        return CopyReference(model, autocast, tokens)
    if kind == "precomputed" and probe:
        return FixedReference()
    return None


class AdapterReference:
    """Reference log-probs from the policy with its LoRA adapters disabled."""

    kind = "adapters"

    def __init__(self, tokens: TokenLoss):
        self.tokens = tokens

    def __call__(self, model, batch: dict) -> torch.Tensor:
        with torch.no_grad(), _peft_model(model).disable_adapter():
            return batch_logps(model, batch, self.tokens)

    def token_logps(self, model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
        """Per target token (GRPO's KL term), under the logits / ``temperature``."""
        with torch.no_grad(), _peft_model(model).disable_adapter():
            return self.tokens.policy_logps(model, batch, temperature)[1]


class CopyReference:
    """Reference log-probs from a frozen copy of the starting model, under the run's autocast."""

    kind = "copy"

    def __init__(self, model, autocast, tokens: TokenLoss):
        self.model, self.autocast, self.tokens = model, autocast, tokens
        self.model.eval().requires_grad_(False)

    def __call__(self, _policy, batch: dict) -> torch.Tensor:
        with torch.no_grad(), self.autocast():
            return batch_logps(self.model, batch, self.tokens)

    def token_logps(self, _policy, batch: dict, temperature: float = 1.0) -> torch.Tensor:
        """Per target token (GRPO's KL term), under the logits / ``temperature``."""
        with torch.no_grad(), self.autocast():
            return self.tokens.policy_logps(self.model, batch, temperature)[1]


class FixedReference:
    """Zero reference log-probs, for the planner's probes of a precomputed-reference setup: they
    time the step, to which precomputed log-probs add nothing, whatever their values."""

    kind = "fixed"

    def __call__(self, _policy, batch: dict) -> torch.Tensor:
        from onegpu.data.pairs import PAIR_INDEX

        index = batch[PAIR_INDEX] if PAIR_INDEX in batch else batch[unpaired.EXAMPLE_INDEX]
        return torch.zeros(2 * index.numel(), device=index.device)


def batch_logps(model, batch: dict, tokens: TokenLoss) -> torch.Tensor:
    """The summed response log-probs a reference gives for a batch, 2n values: a pair batch's
    chosen then rejected sequences (one forward), or a KTO batch's n examples then its n
    mismatched sequences (data/unpaired.py; two forwards)."""
    from onegpu.objectives.preference import sequence_logps

    sums = sequence_logps(model, batch, tokens)[1]
    kl = unpaired.mismatched(batch)
    if not kl:
        return sums
    return torch.cat([sums, sequence_logps(model, kl, tokens)[1]])


def _peft_model(model):
    inner = getattr(model, "module", model)  # DistributedDataParallel
    if not hasattr(inner, "disable_adapter"):
        raise TypeError("preference.reference=adapters needs a PEFT (LoRA) model")
    return inner


# ----------------------------------------------------------------------------------- precomputed
def precompute(
    model,
    tokens: TokenLoss,
    train_ds,
    val_ds,
    collator,
    micro_batch: int,
    run_dir: Path,
    device,
    resumed: bool,
    is_main: bool = True,
):
    """(train_ds, val_ds, seconds): the datasets with the reference log-probs of every pair as two
    more columns, and the time the pass took (None when read back).

    A resumed run reads them from its run directory; a fresh run computes them with ``model`` as it
    is now (its starting weights) and writes them there.
    """
    path = Path(run_dir) / FILE
    columns = collator.reference_columns  # the two halves of batch_logps, as dataset columns
    splits = {"train": train_ds, "validation": val_ds}
    seconds = None
    if resumed:
        if not path.is_file():
            raise DataError(
                f"{path} is missing: a resumed DPO run needs the reference log-probs computed from "
                "its starting weights.",
                hint="restore the file, or start the run again with --output.overwrite true",
            )
        saved = _load(path)
    else:
        t0 = time.perf_counter()
        saved = {
            f"{name}.{col}": v
            for name, ds in splits.items()
            if ds is not None
            for col, v in zip(
                columns,
                compute(model, ds, tokens, collator, micro_batch, device),
                strict=True,
            )
        }
        seconds = time.perf_counter() - t0
        if is_main:
            _save(path, saved)
        log.info(
            "reference log-probs: %d records in %.1fs (%s)",
            sum(len(v) for k, v in saved.items() if k.endswith(columns[0])),
            seconds,
            path.name,
        )
    out = {}
    for name, ds in splits.items():
        if ds is None:
            out[name] = None
            continue
        chosen, rejected = saved.get(f"{name}.{columns[0]}"), saved.get(f"{name}.{columns[1]}")
        if chosen is None or len(chosen) != len(ds):
            raise DataError(
                f"{path}: its {name} reference log-probs do not match the data ({len(ds)} "
                "examples).",
                hint="the data changed since the run began: start it again with --output.overwrite "
                "true",
            )
        out[name] = ds.add_column(columns[0], chosen.tolist()).add_column(
            columns[1], rejected.tolist()
        )
    return out["train"], out["validation"], seconds


@torch.no_grad()
def compute(
    model, ds, tokens: TokenLoss, collator, micro_batch: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probs of every pair of ``ds`` under ``model`` as it is now (for
    KTO: of every example, and of its mismatched sequence). The model is the prepared one: it runs
    under the run's autocast by itself."""
    from onegpu.data.batches import eval_batches
    from onegpu.objectives.tokens import with_target_positions

    chosen, rejected = [], []
    was_training = model.training
    model.eval()
    try:
        # compiled blocks run eagerly: one pass does not repay compiling their no-grad variant
        with torch.compiler.set_stance("force_eager"):
            for batch in eval_batches(ds, micro_batch, collator):
                batch = {k: v.to(device) for k, v in with_target_positions(batch).items()}
                sums = batch_logps(model, batch, tokens).float().cpu()
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
