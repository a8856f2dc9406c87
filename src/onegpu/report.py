"""Metrics out: metrics.jsonl (one record per line), the experiment trackers (trackers.py), and loss.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from onegpu.trackers import Trackers


class MetricsLog:
    """Append-only jsonl, each record also sent to the trackers named (trackers.resolve). Only the main
    process writes. As a context manager it closes the trackers at the end, marked failed on an error."""

    def __init__(self, run_dir: Path, trackers: Sequence[str] = ("tensorboard",), enabled: bool = True,
                 purge_step: int | None = None, config: Any = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._fh = open(self.path, "a", encoding="utf-8") if enabled else None
        self._trackers = None
        if enabled and trackers:
            try:  # a tracker that fails to start leaves no file open
                self._trackers = Trackers(list(trackers), run_dir, config or {}, purge_step=purge_step)
            except BaseException:
                self._fh.close()
                raise

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._trackers is not None:
            self._trackers.log(record)

    def close(self, failed: bool = False) -> None:
        if self._fh:
            self._fh.close()
            self._fh = None
        if self._trackers is not None:
            self._trackers.finish(failed=failed)
            self._trackers = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


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

def device_memory_gb(device) -> float:
    """Peak allocated GPU memory, or the process's resident memory on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**30
    except ImportError:
        return 0.0


def progress_bar(total: int, enabled: bool, initial: int = 0):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)


def print_summary(r) -> None:
    first = f"{r.first_eval:.3f}" if r.first_eval is not None else "n/a"
    last = f"{r.last_eval:.3f}" if r.last_eval is not None else "n/a"
    print(f"done: {r.state.step} steps, {r.state.tokens_seen:,} tokens in {r.wall_seconds:.0f}s "
          f"({r.tokens_per_second:,.0f} tokens/s); val loss {first} -> {last}")
    for stats in r.data_stats:
        print(f"data {stats.describe()}")
    print(f"run directory: {r.run_dir}\n  config.yaml, metrics.jsonl, tensorboard/, loss.png")
    print(f"  model: {r.final_dir}\n  try: onegpu generate --model {r.final_dir} \"def fib(\"")

