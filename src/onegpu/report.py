"""Metrics out: metrics.jsonl (one record per line), the experiment trackers (trackers.py), and
loss.png."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onegpu.trackers import Trackers


class MetricsLog:
    """Append-only jsonl, each record also sent to the trackers named (trackers.resolve), which get
    ``config`` (default: the run directory's config.yaml) once. Only the main process writes. As a
    context manager it closes the trackers at the end, marked failed on an error."""

    def __init__(
        self,
        run_dir: Path,
        trackers: Sequence[str] = ("tensorboard",),
        enabled: bool = True,
        purge_step: int | None = None,
        config: Any = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._fh = open(self.path, "a", encoding="utf-8") if enabled else None
        self._trackers = None
        if enabled and trackers:
            try:  # a tracker that fails to start leaves no file open
                self._trackers = Trackers(list(trackers), run_dir, config, purge_step=purge_step)
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
        ax.plot(*zip(*train, strict=True), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", lw=1.5)
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

    return tqdm(
        total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0
    )


RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "tensorboard",
    "loss.png",
    "reference_logps.safetensors",
)


def print_summary(r) -> None:
    first = f"{r.first_eval:.3f}" if r.first_eval is not None else "n/a"
    last = f"{r.last_eval:.3f}" if r.last_eval is not None else "n/a"
    s = r.state
    # What this process trained, over this process's time: after a resume, the steps before it
    # were another process's work (and time)
    resumed = (
        f" (resumed at step {s.start_step}: {s.trained_steps} steps here)" if s.start_step else ""
    )
    # The rate is over the steps' own time (evaluation and saving left out), so that time is the
    # one shown next to it; the process's whole time is shown apart: one figure for both, as before,
    # made "81,920 tokens in 10s" read as 8,192 tokens/s beside a printed 14,051.
    print(
        f"done: {s.step} steps{resumed}, {s.trained_tokens:,} tokens trained in "
        f"{_seconds(s.timed_seconds)} of training steps ({r.tokens_per_second:,.0f} tokens/s; "
        f"{_seconds(r.wall_seconds)} in all, with start-up, evaluation and saving); "
        f"val loss {first} -> {last}" + _val_reward(r.run_dir / "metrics.jsonl")
    )
    for stats in r.data_stats:
        print(f"data {stats.describe()}")
    files = [
        name + ("/" if (r.run_dir / name).is_dir() else "")
        for name in RUN_FILES
        if (r.run_dir / name).exists()
    ]
    print(f"run directory: {r.run_dir}\n  {', '.join(files)}")
    fmt = r.data_stats[0].fmt if r.data_stats else "text"
    if _scores(r.final_dir):  # a reward model generates nothing: say how it is used
        print(
            f"  model: {r.final_dir} (a reward model: AutoModelForSequenceClassification, or "
            f"--grpo.rewards '[{r.final_dir}]')"
        )
        return
    if (Path(r.final_dir) / "preprocessor_config.json").is_file():  # a VLM's processor beside it
        print(
            f"  model: {r.final_dir} (a vision-language model and its processor: "
            "AutoModelForImageTextToText and AutoProcessor load it; docs/vlm.md)"
        )
        return
    print(f"  model: {r.final_dir}\n  try: {generate_hint(r.final_dir, fmt, r.sample_prompt)}")


def _scores(model_dir) -> bool:
    """The saved model is a sequence-classification one (training.objective reward)."""
    import json
    from pathlib import Path

    adapter, config = Path(model_dir) / "adapter_config.json", Path(model_dir) / "config.json"
    if adapter.is_file():  # a LoRA run's adapter: PEFT's task type says
        return json.loads(adapter.read_text()).get("task_type") == "SEQ_CLS"
    if not config.is_file():
        return False
    archs = json.loads(config.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def _seconds(x: float) -> str:
    return f"{x:.1f}s" if x < 10 else f"{x:,.0f}s"


def _val_reward(path) -> str:
    """ ", val reward a -> b" for a run whose evaluations score rewards (GRPO), else ""."""
    if not path.is_file():
        return ""
    rewards = [r["reward"] for r in read_metrics(path) if r.get("split") == "val" and "reward" in r]
    return f", val reward {rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else ""


# the default corpus is the standard library's source: a code prompt fits it
DEFAULT_PROMPT = "def fib("


def generate_hint(model_dir, fmt: str, sample: str | None) -> str:
    """The generate command that fits what the model learnt: a chat-tuned model gets a user turn
    from its data through its chat template (--chat true), any other model a prompt from its data.
    """
    import shlex

    chat = " --chat true" if fmt == "messages" else ""
    return (
        f"onegpu generate --model {shlex.quote(str(model_dir))}{chat} "
        f"{_quoted(sample or DEFAULT_PROMPT)}"
    )


def sample_prompt(records, fmt: str, data_cfg, limit: int = 60) -> str | None:
    """A prompt from the data for the end-of-run hint: a chat's first user turn, a record's prompt,
    or a text's first line; its first line only, cut at a word to about ``limit`` characters."""
    if (
        records is None or len(records) == 0 or data_cfg.path is None
    ):  # the default corpus: DEFAULT_PROMPT
        return None
    rec = records[0]
    if fmt == "messages":
        turns = rec.get(data_cfg.messages_field) or []
        text = next(
            (t.get("content") for t in turns if isinstance(t, dict) and t.get("role") == "user"),
            None,
        )
    elif fmt in ("prompt_completion", "preference", "unpaired"):
        text = rec.get(data_cfg.prompt_field)
    else:
        text = rec.get(data_cfg.text_field)
    lines = (
        [line.strip() for line in text.splitlines() if line.strip()]
        if isinstance(text, str)
        else []
    )
    if not lines:
        return None
    line = lines[0]
    if len(line) > limit:
        line = line[:limit].rsplit(" ", 1)[0] if " " in line[:limit] else line[:limit]
    return line


def _quoted(prompt: str) -> str:
    """Double quotes as in the docs, unless the shell would read something inside them."""
    import shlex

    return f'"{prompt}"' if not any(c in prompt for c in '"$`\\!') else shlex.quote(prompt)
