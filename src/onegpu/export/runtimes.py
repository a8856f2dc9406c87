"""The two sides of the check as token ids and logit rows: onegpu's decode engine on the source
model (greedy, every prompt for exactly n new tokens) with the source's own teacher-forced logits,
and the export in transformers (a cached greedy loop recording each step's logits)."""

from __future__ import annotations

import inspect

import numpy as np


def engine_greedy(model, tokenizer, ids: list[list[int]], n: int) -> list[list[int]]:
    """onegpu's engine, greedy, ``n`` new tokens per prompt (EOS does not end them: the check
    compares a fixed length)."""
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.requests import SamplingParams

    need = -(-(max(map(len, ids)) + n) // 64) * 64
    engine = Engine(
        model, tokenizer, EngineConfig(max_slots=min(8, len(ids)), max_len=need, compile="off")
    )
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for _ in ids]
    return [list(r.token_ids) for r in engine.generate(ids, params)]


def forced_rows(model, prompt: list[int], new: list[int]) -> np.ndarray:
    """The model's logits for each of ``new`` given the prompt and the new tokens before it, in one
    forward ([len(new), vocab], float32)."""
    import torch

    ids = torch.tensor([prompt + new], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(new)].cpu().numpy()


def transformers_greedy(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding with transformers' KV cache: (new tokens, the logits row each came from)."""
    import torch

    device = model.device
    # transformers 5 renamed past_key_values to cache (the old name warns); a model's own code
    # may still take only the old one
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out: list[int] = []
    rows = []
    with torch.inference_mode():
        step = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        for _ in range(n):
            row = step.logits[0, -1].float()
            rows.append(row.cpu().numpy())
            out.append(int(row.argmax()))
            past = getattr(step, "cache", None) or step.past_key_values
            step = model(
                input_ids=torch.tensor([[out[-1]]], device=device), use_cache=True, **{name: past}
            )
    return out, np.stack(rows)


def load_transformers(folder, trust_remote_code: bool = False):
    """The safetensors export as any user loads it: AutoModelForCausalLM with its saved dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype="auto", trust_remote_code=trust_remote_code
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer
