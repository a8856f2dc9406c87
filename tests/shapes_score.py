"""A tiny LLaVA trained on the shapes dataset and scored by the colour of held-out images: what
benchmarks/vlm_shapes.py measured once (at c0ae3d3; results/vlm-shapes-cpu.md), kept for its slow
test. Scoring: for each held-out image, the log-probability of "a <colour> <shape>" (its true
shape) for each of the 4 colours, teacher-forced after the user turn; the colour with the highest
is the model's answer."""

from __future__ import annotations

import json
from pathlib import Path


def train_run(folder: Path, model: Path, steps: int, name: str) -> Path:
    from onegpu import train

    cfg = {
        "model": {"name": str(model)},
        "data": {
            "path": str(folder / "train.jsonl"),
            "seq_len": 64,
            "pad_to_multiple": 8,
            "num_proc": 1,
            "val_fraction": 0.0,
        },
        "training": {
            "micro_batch_size": 16,
            "max_steps": steps,
            "lr": 3e-3,
            "warmup_steps": 10,
            "eval_every": 0,
            "log_every": 10,
            "seed": 0,
        },
        "techniques": {"vision": "all", "compile": "off"},
        "output": {"dir": str(folder / "runs"), "name": name, "report_to": "none"},
    }
    return train(cfg).final_dir


def colour_accuracy(final: Path, held_out: Path) -> tuple[float, int]:
    """Share of held-out records whose true colour scores highest (see the module docstring)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from onegpu import shapes, vlm
    from onegpu.data.images import open_image

    processor = vlm.load_processor(str(final))
    model = AutoModelForImageTextToText.from_pretrained(str(final)).eval()
    right = total = 0
    for line in (held_out / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        user = rec["messages"][0]
        truth = rec["messages"][1]["content"]  # "a <colour> <shape>"
        _, colour, shape = truth.split()
        image = open_image(str(held_out / user["content"][0]["image"]), "held out")
        scores = {}
        for c in shapes.COLOURS:
            conv = [
                {"role": "user", "content": [{"type": "image"}, user["content"][1]]},
                {"role": "assistant", "content": shapes.caption(c, shape)},
            ]
            prompt = processor.apply_chat_template(
                conv[:1], tokenize=False, add_generation_prompt=True
            )
            full = processor.apply_chat_template(conv, tokenize=False)
            enc = processor(
                text=[full], images=[[image]], add_special_tokens=False, return_tensors="pt"
            )
            start = len(
                processor(text=[prompt], images=[[image]], add_special_tokens=False)["input_ids"][0]
            )
            with torch.no_grad():
                logits = model(**enc).logits[0].float().log_softmax(-1)
            ids = enc["input_ids"][0]
            scores[c] = sum(float(logits[t - 1, ids[t]]) for t in range(start, len(ids)))
        right += max(scores, key=scores.get) == colour
        total += 1
    return right / total, total
