"""A trained reward model as one of GRPO's rewards (grpo.rewards: the model's folder, e.g. a
training.objective=reward run's ``final``): scored in the training process, batched, as TRL's
GRPOTrainer scores a PreTrainedModel reward (``_calculate_rewards``): each prompt + completion as
one text (chat prompts through the reward tokenizer's chat template), tokenized without special
tokens, right-padded, and the head's one logit its reward.

The folder is checked when the rewards are resolved (before the policy loads); the model loads at
the first scoring, on the policy's kind of device, and stays for the run, held by the function.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from onegpu.errors import ConfigError

BATCH = 32  # texts per scoring forward: bounded memory whatever the step's completions


def is_reward_model(name: str) -> bool:
    """``name`` is a folder holding a model (its config.json)."""
    return (Path(name) / "config.json").is_file()


def reward_model(path: str) -> Callable:
    """The reward function of the model in ``path``, with TRL's signature."""
    config = json.loads((Path(path) / "config.json").read_text())
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs) or (
        len(config.get("id2label") or {"0": 0}) != 1
    ):
        raise ConfigError(
            f"grpo.rewards: {path} holds a {', '.join(archs) or 'model'}, not a reward model (a "
            "sequence-classification model with one output).",
            hint="train one with --training.objective reward and give its final folder",
        )
    loaded: dict = {}  # the model and tokenizer once loaded: this function's, for the run

    def score(prompts, completions, **_) -> list[float]:
        import torch

        if not loaded:
            loaded.update(_load(path))
        model, tok = loaded["model"], loaded["tokenizer"]
        texts = [_text(tok, p, c) for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        with torch.inference_mode():
            for s in range(0, len(texts), BATCH):
                enc = tok(
                    texts[s : s + BATCH],
                    return_tensors="pt",
                    padding=True,
                    padding_side="right",
                    add_special_tokens=False,
                ).to(model.device)
                out += model(**enc).logits[:, 0].float().tolist()
        return out

    score.__name__ = Path(path).name
    return score


def _load(path: str) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:  # as TRL: the head needs a pad token to find each row's end
        tok.pad_token = tok.eos_token
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else None
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    model.config.pad_token_id = tok.pad_token_id
    return {"model": model.to(device).eval().requires_grad_(False), "tokenizer": tok}


def _text(tok, prompt, completion) -> str:
    if isinstance(prompt, list):  # chat: the conversation so far and the completion's message
        return tok.apply_chat_template(prompt + completion, tokenize=False)
    return prompt + completion
