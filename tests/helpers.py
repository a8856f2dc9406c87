"""Plain helpers shared by the test modules (fixtures live in conftest.py): the tiny corpus and
model, random batches, the small-run config and its read-back, and fault injection for the loss."""

from __future__ import annotations

import json
import shutil

import torch
from torch.overrides import TorchFunctionMode

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog.\n",
] * 20

IGNORE = -100  # the label of a position that is not trained (transformers' ignore_index)


def make_tiny_llama(tokenizer, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**kw))


def random_batch(
    vocab: int,
    n: int = 2,
    length: int = 16,
    seed: int = 0,
    masked_prefix: int = 0,
    device: str = "cpu",
) -> dict:
    """n rows of `length` random token ids below `vocab` (a fixed generator: the same batch on every
    call), labels equal to the ids except the first `masked_prefix` positions of each row."""
    ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed)).to(
        device
    )
    labels = ids.clone()
    labels[:, :masked_prefix] = IGNORE
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


# ------------------------------------------------------------------- small training runs
def write_data(tmp_path, n: int = 60):
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(json.dumps({"text": CORPUS[i % len(CORPUS)] * 2}) + "\n" for i in range(n))
    )
    return path


def make_cfg(tmp_path, model_dir, name="run", **training):
    t = dict(
        micro_batch_size=2,
        grad_accum=2,
        max_steps=6,
        eval_every=3,
        eval_batches=2,
        log_every=1,
        warmup_steps=2,
        save_every=3,
        lr=1e-2,
        seed=7,
    )
    t.update(training)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_data(tmp_path)
    return {
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "seq_len": 32, "num_proc": 1, "val_fraction": 0.1},
        "training": t,
        "techniques": {},
        "output": {
            "dir": str(tmp_path / "runs"),
            "name": name,
            "report_to": "none",
            "keep_last": 10,
        },
    }


def losses(run_dir) -> list[tuple]:
    """(split, step, loss) of every record: timing fields differ between runs, the math must not."""
    from onegpu.report import read_metrics

    return [
        (r["split"], r["step"], r.get("loss"), r.get("skipped"))
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def weights(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def straight_then_resumed(tmp_path, model_dir, techniques=None, resume_at=3, **training):
    """Run 2N steps, then redo the second half from the N-step checkpoint in the same run dir."""
    from onegpu import train

    cfg = make_cfg(tmp_path, model_dir, **training)
    cfg["techniques"].update(techniques or {})
    first = train(cfg)
    run = first.run_dir
    expected = losses(run)
    saved_final = tmp_path / "final-straight"
    shutil.copytree(run / "final", saved_final)
    cfg["output"]["resume"] = str(run / f"checkpoint-{resume_at:08d}")
    second = train(cfg)
    assert second.state.step == cfg["training"]["max_steps"]
    return expected, losses(run), saved_final, run / "final"


# ------------------------------------------------------------------------- fault injection
def oom_above(limit: int, real_make):
    """A make_objective whose training loss raises OutOfMemoryError for micro-batches above
    `limit`."""

    def make(*args):
        objective = real_make(*args)
        fn = objective.loss

        def loss(model, batch):
            if model.training and batch["input_ids"].shape[0] > limit:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return fn(model, batch)

        objective.loss = loss
        return objective

    return make


def nan_at(steps: set, real_make, grad_accum: int = 1):
    """A make_objective whose loss is NaN during the given optimizer steps (1-based)."""

    def make(*args):
        objective = real_make(*args)
        fn = objective.loss
        calls = {"n": 0}

        def loss(model, batch):
            if not model.training:
                return fn(model, batch)
            calls["n"] += 1
            step = (calls["n"] - 1) // grad_accum + 1
            out = fn(model, batch)
            return out * float("nan") if step in steps else out

        objective.loss = loss
        return objective

    return make


# ------------------------------------------------------------------------------ checkpoints
class Parts:
    """A tiny model, optimizer and scheduler, stepped and saved as a checkpoint the loop's way."""

    def __init__(self, tokenizer):
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        self.model = make_tiny_llama(tokenizer)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (s + 1))
        self.tokenizer = tokenizer

    def step(self):
        ids = torch.randint(5, 100, (2, 16))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()

    def save(self, run_dir, step, eval_loss=None, on_write=None):
        from onegpu.checkpoint import local as checkpoint

        state = {
            "step": step,
            "batches_seen": step,
            "tokens_seen": 0,
            "best_eval": 1.0,
            "history": [],
            "eval_loss": eval_loss,
        }
        return checkpoint.save_checkpoint(
            run_dir,
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            state,
            self.accelerator,
            self.tokenizer,
            {"training": {"lr": 1e-3}},
            on_write=on_write,
        )


# ----------------------------------------------------------------------- what a model really does
def saved_tensor_bytes(model, fn) -> int:
    """Bytes of distinct tensors, other than ``model``'s weights, autograd keeps for backward while
    ``fn()`` runs.

    This is the activation memory a training step holds at the end of its forward. Checkpointed
    regions save through their own inner hooks, so only what is really kept is counted; tensors
    sent to host memory by an inner offload hook are not counted either.
    """
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[tuple, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            key = (t.untyped_storage().data_ptr(), t.device)
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def attention_of(model) -> str:
    """The attention implementation a loaded model really uses."""
    return model.config._attn_implementation


def is_compiled(module) -> bool:
    """Whether ``module`` itself runs through torch.compile (in-place compile)."""
    return module._compiled_call_impl is not None


def is_quantized_layer(module) -> bool:
    """True for one layer stored quantized: a bitsandbytes quantized Linear, or a Linear whose
    weight is a torchao tensor subclass."""
    if type(module).__name__ in ("Linear8bitLt", "Linear4bit", "LinearNF4", "LinearFP4"):
        return True
    weight = getattr(module, "weight", None)
    return weight is not None and type(weight).__module__.startswith("torchao")


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that count in the loss: labels shifted by one, -100 excluded."""
    from onegpu.objectives.tokens import IGNORE

    return int((labels[:, 1:] != IGNORE).sum())


def peak_cpu_bytes(fn) -> int:
    """Peak bytes held by torch's CPU allocator while ``fn()`` runs, from the profiler's trace of
    every allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def benchmark_script(name: str, folder: str = "benchmarks"):
    """``<folder>/<name>.py`` imported as a module (the benchmarks and scripts are scripts, not a
    package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


class HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's values to the host (each one a device sync on a
    GPU): tolist, item, cpu, numpy and the conversions to Python numbers and bools."""

    READS = {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
    }

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))
