"""Metrics out: metrics.jsonl (one record per line), TensorBoard events, and loss.png."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    """Append-only jsonl plus TensorBoard scalars. Only the main process writes."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True, purge_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._fh = open(self.path, "a", encoding="utf-8") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: after a resume, TensorBoard hides the events of the steps being redone
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge_step)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None and "step" in record:
            prefix = record.get("split", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "split") and math.isfinite(v):
                    self._tb.add_scalar(f"{prefix}/{k}", v, record["step"])

    def close(self) -> None:
        if self._fh:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def plot_loss(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Train and validation loss against optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in recs if r.get("split") == "train" and "loss" in r]
    val = [(r["step"], r["loss"]) for r in recs if r.get("split") == "val" and "loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return Path(out_png)
