"""Popular causal-LM families fine-tune as users run them: a tiny model of each family, saved with
save_pretrained, trained through ``onegpu.train`` with the defaults, with LoRA and with QLoRA; the
loss falls, the default fast paths (fused loss, attention=auto) really serve the family, ``final/``
reloads through inference loading, and the reloaded model generates."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from families import FAMILIES, tiny_family_model
from onegpu import train
from onegpu.infer import InferConfig, SamplingConfig, generate, load
from onegpu.report import read_metrics
from onegpu.training.state import Callback

pytest.importorskip("peft")

# MoE families whose transformers code has a load-balancing loss (DeepSeek-V3 balances by bias).
MOE_ROUTER_LOSS = {"qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"}
# Attention SDPA cannot express (logit soft-capping, attention sinks): attention=auto picks eager.
EAGER_ONLY = {"gemma2", "gpt_oss"}

# Every family trains in full in the fast tier; with adapters only these (a plain Llama, a MoE with
# a router loss, an eager-only family, GPT-2's Conv1D layers): the rest in the slow tier.
ADAPTER_FAMILIES_FAST = {"llama", "mixtral", "gemma2", "gpt2"}

LORA = {"enabled": True, "r": 8, "alpha": 16}
# techniques, learning rate, the least fall of the train loss over the 8 steps. The falls measured
# here: over 2 nats for every family trained in full, 0.6 or more with adapters (a rank-8 update
# under a frozen random head moves the logits less).
MODES = {
    "full": ({}, 1e-2, 1.0),
    "lora": ({"lora": LORA}, 5e-2, 0.3),
    # QLoRA as its recipe runs it: 4-bit base, adapters, checkpointed layers.
    "qlora": ({"lora": {**LORA, "quantize_base": "nf4"}, "checkpointing": "full"}, 5e-2, 0.3),
}
# A QLoRA run read back with its base requantized to nf4: the logits of the trained model within
# this much (measured: equal for most families, 0.025 at most on olmo2's tiny model).
NF4_RELOAD_ATOL = 0.05
# QLoRA runs checked on the default full-precision reload only:
# - qwen2_moe, deepseek_v3: loaded in 4 bits for inference, their tiny models fail inside
#   bitsandbytes' CPU 4-bit matmul ("N must be divisible by block_n" on the 4-expert router; a
#   reshape to [64, 0]), though training ran on the quantized layers;
# - the other MoE families: a requantization difference of the size olmo2 shows can flip a
#   token's top-k experts, and the logits with them (mixtral: 1.9 on 15% of them, measured).
NF4_RELOAD_REFUSED = {"qwen2_moe", "deepseek_v3", "mixtral", "qwen3_moe", "gpt_oss"}
# (family, mode) that cannot run here, with the reason; an entry is an expected failure (strict).
BROKEN: dict[tuple[str, str], str] = {
    (
        "falcon",
        "qlora",
    ): "transformers quantizes only layers whose type is exactly nn.Linear; Falcon's are "
    "FalconLinear, so its base stays full precision (onegpu warns; see the test below)",
}


def _matrix():
    for family in FAMILIES:
        for mode in MODES:
            reason = BROKEN.get((family, mode))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            if mode != "full" and family not in ADAPTER_FAMILIES_FAST:
                marks.append(pytest.mark.slow)
            yield pytest.param(family, mode, id=f"{family}-{mode}", marks=marks)


@pytest.fixture(scope="module")
def saved_family(tmp_path_factory, tiny_tokenizer):
    """family -> a folder with its tiny model and the tiny tokenizer, both from save_pretrained."""

    tok, done = tiny_tokenizer, {}

    def get(family: str):
        if family not in done:
            model = tiny_family_model(family, tok)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(str(path))
            tok.save_pretrained(str(path))
            done[family] = path
        return done[family]

    return get


class Seen(Callback):
    """What the run really used: loss function, attention kernel, 4-bit layers, checkpointed
    layers, the MoE router loss."""

    def on_train_begin(self, run, state):
        from onegpu.techniques.checkpointing import checkpointed_layers

        config = run.model.config
        self.attention = config._attn_implementation
        self.four_bit = any(
            type(m).__name__ == "Linear4bit" for m in run.model.modules()
        )  # bitsandbytes
        self.checkpointed = len(checkpointed_layers(run.model))
        self.router_loss = bool(getattr(config, "output_router_logits", False))
        self.layers = config.num_hidden_layers

    def on_train_end(self, run, state):
        self.fused = run.objective.tokens.fused  # False after a fallback to the plain loss
        self.logits, self.greedy = _reference(run.model, self.tokenizer)


PROMPT = "def add(a, b):"
NEW_TOKENS = 4


def _reference(model, tokenizer):
    """A model's logits over the prompt, and its greedy continuation (argmax, no cache). Run with
    autograd on: bitsandbytes' CPU 4-bit matmul refuses some tiny layers under no_grad (see
    NF4_RELOAD_REFUSED), its autograd path does not."""
    ids = torch.tensor(tokenizer([PROMPT])["input_ids"], device=model.device)
    was_training = model.training
    model.eval()
    with torch.enable_grad():
        logits = model(input_ids=ids).logits.detach().float().cpu()
        tokens = []
        for _ in range(NEW_TOKENS):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            tokens.append(int(nxt))
            if int(nxt) == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train(was_training)
    return logits, tokens


@pytest.mark.parametrize("family,mode", list(_matrix()))
def test_family_trains_reloads_and_generates(family, mode, saved_family, text_file, tmp_path):
    techniques, lr, least_fall = MODES[mode]
    cfg = {
        "model": {"name": str(saved_family(family))},
        "data": {"path": str(text_file), "seq_len": 32, "num_proc": 1},
        "training": {
            "micro_batch_size": 2,
            "max_steps": 8,
            "eval_every": 0,
            "eval_batches": 2,
            "warmup_steps": 1,
            "log_every": 1,
            "lr": lr,
        },
        "techniques": techniques,
        "output": {"dir": str(tmp_path), "name": "run", "report_to": "none"},
    }
    seen = Seen()
    seen.tokenizer = AutoTokenizer.from_pretrained(str(saved_family(family)))
    train(cfg, callbacks=[seen])

    run = tmp_path / "run"
    losses = [
        r["loss"]
        for r in read_metrics(run / "metrics.jsonl")
        if r["split"] == "train" and "loss" in r
    ]
    assert len(losses) == 8 and losses[-1] < losses[0] - least_fall, losses
    assert seen.fused, "the fused loss fell back to the plain loss"
    assert seen.attention == ("eager" if family in EAGER_ONLY else "sdpa")
    assert seen.four_bit == (mode == "qlora")
    assert seen.checkpointed == (seen.layers if mode == "qlora" else 0)
    assert seen.router_loss == (family in MOE_ROUTER_LOSS)

    assert (run / "final" / ("adapter_config.json" if mode != "full" else "config.json")).is_file()
    loaded = load(InferConfig(model=str(run)))  # as `onegpu generate` loads it
    assert hasattr(loaded.model, "peft_config") == (mode != "full")
    assert loaded.model.config._attn_implementation == seen.attention
    logits, greedy = _reference(loaded.model, loaded.tokenizer)
    if mode != "qlora":  # the reloaded model computes what the trained one did
        torch.testing.assert_close(logits, seen.logits, rtol=1e-4, atol=1e-4)
        assert greedy == seen.greedy
    elif family not in NF4_RELOAD_REFUSED:  # adapters on the 4-bit base they were trained on
        nf4 = load(InferConfig(model=str(run), quantization="nf4")).model
        requantized = _reference(nf4, loaded.tokenizer)[0]
        torch.testing.assert_close(requantized, seen.logits, rtol=0, atol=NF4_RELOAD_ATOL)
    out = generate(
        loaded.model, loaded.tokenizer, [PROMPT], SamplingConfig(max_new_tokens=4, greedy=True)
    )
    # the engine's greedy answer is the reloaded model's argmax continuation
    assert out[0].new_tokens == len(greedy)
    assert out[0].text == loaded.tokenizer.decode(greedy, skip_special_tokens=True)
    assert out[0].finish_reason == ("length" if len(greedy) == NEW_TOKENS else "stop")


def test_qlora_on_a_model_bitsandbytes_cannot_quantize_warns(saved_family, caplog):
    import logging

    from onegpu.config import LoraConfig, ModelConfig, TechniquesConfig
    from onegpu.models import load_model
    from onegpu.techniques.lora import apply_lora, quantization_config

    path = str(saved_family("falcon"))
    tcfg = TechniquesConfig(lora=LoraConfig(enabled=True, r=4, quantize_base="nf4"))
    quant = quantization_config(tcfg, "fp32", path, ModelConfig(name=path))
    model = load_model(path, ModelConfig(name=path), None, extra={"quantization_config": quant})
    with caplog.at_level(logging.WARNING, logger="onegpu"):
        apply_lora(model, tcfg)
    assert "no layer of FalconForCausalLM was quantized" in caplog.text
