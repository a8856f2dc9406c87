"""Mixture-of-Experts models train with their router load-balancing loss included."""

from __future__ import annotations

import pytest
import torch

from helpers import random_batch
from onegpu.objectives.sft import loss_sum
from onegpu.objectives.tokens import IGNORE
from onegpu.techniques.moe import apply_moe_aux_loss


def _mixtral(tok):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=128,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )


def _qwen_moe(tok):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=128,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )


BUILDERS = {"mixtral": _mixtral, "qwen2_moe": _qwen_moe}


def _router_weights(model):
    return {n: p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_aux_loss_term_is_added_and_reaches_the_router(tiny_tokenizer, arch):
    torch.manual_seed(0)
    model = BUILDERS[arch](tiny_tokenizer)
    assert apply_moe_aux_loss(model, "cpu") and model.config.output_router_logits
    model.train()
    batch = random_batch(len(tiny_tokenizer), length=24, seed=4)
    batch["labels"][0, :6] = IGNORE  # one row with a prompt that does not count
    n_targets = int((batch["labels"][:, 1:] != IGNORE).sum())
    losses, router_grads = {}, {}
    for coef in (0.0, 0.5):
        model.config.router_aux_loss_coef = coef
        model.zero_grad(set_to_none=True)
        loss = loss_sum(model, batch)
        loss.backward()
        losses[coef] = loss.detach()
        router_grads[coef] = {n: p.grad.clone() for n, p in _router_weights(model).items()}
    with torch.no_grad():
        aux = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).aux_loss
    assert aux is not None and aux > 0
    # exactly coef x aux x target tokens: the token-sum convention of loss_sum
    assert torch.allclose(losses[0.5] - losses[0.0], 0.5 * aux * n_targets, rtol=1e-4)
    assert len(router_grads[0.5]) == model.config.num_hidden_layers
    for name, g in router_grads[0.5].items():
        assert not torch.allclose(g, router_grads[0.0][name]), (
            name
        )  # the aux loss trains the router


def test_aux_loss_also_with_chunked_loss_and_not_in_eval(tiny_tokenizer):
    torch.manual_seed(0)
    model = _mixtral(tiny_tokenizer)
    apply_moe_aux_loss(model, "cpu")
    batch = random_batch(len(tiny_tokenizer), length=24, seed=4)
    batch["labels"][0, :6] = IGNORE  # one row with a prompt that does not count
    model.train()
    assert torch.allclose(loss_sum(model, batch), loss_sum(model, batch, chunk_size=8), rtol=1e-5)
    model.eval()
    with torch.no_grad():
        model.config.router_aux_loss_coef = 10.0
        high = loss_sum(model, batch)
        model.config.router_aux_loss_coef = 0.0
        assert torch.equal(high, loss_sum(model, batch))  # validation loss is plain cross-entropy


def test_dense_models_are_left_alone(tiny_tokenizer):
    from helpers import make_tiny_llama

    model = make_tiny_llama(tiny_tokenizer, num_hidden_layers=1)
    assert not apply_moe_aux_loss(model, "cpu")


def test_moe_model_trains_through_the_loop(tmp_path, tiny_tokenizer, text_file):
    """The loop trains a Mixtral with its router loss: two runs from the same weights and data,
    the model's router_aux_loss_coef 0.5 and 0, log first losses that differ by exactly 0.5 x the
    router loss of that step's forward; both train the routers."""
    from accelerate.state import AcceleratorState

    from onegpu import train
    from onegpu.report import read_metrics
    from onegpu.training.state import Callback

    class RouterLoss(Callback):  # the aux loss of each training forward
        def __init__(self):
            self.seen = []

        def on_train_begin(self, run, state):
            def keep(module, args, kwargs, out):
                if module.training and out.aux_loss is not None:
                    self.seen.append(float(out.aux_loss))

            run.model.register_forward_hook(keep, with_kwargs=True)

    torch.manual_seed(0)
    start = _mixtral(tiny_tokenizer)
    runs = {}
    for coef in (0.5, 0.0):
        model_dir = tmp_path / f"tiny-mixtral-{coef}"
        start.config.router_aux_loss_coef = coef
        start.save_pretrained(str(model_dir))
        tiny_tokenizer.save_pretrained(str(model_dir))
        AcceleratorState._reset_state()
        aux = RouterLoss()
        r = train(
            {
                "model": {"name": str(model_dir)},
                "data": {"path": str(text_file), "seq_len": 32, "num_proc": 1},
                "training": {
                    "micro_batch_size": 4,
                    "max_steps": 2,
                    "eval_every": 0,
                    "eval_batches": 1,
                    "warmup_steps": 1,
                    "log_every": 1,
                },
                "output": {"dir": str(tmp_path), "name": f"run-{coef}", "report_to": "none"},
            },
            callbacks=[aux],
        )
        assert r.state.step == 2 and getattr(r.state, "skipped_steps", 0) == 0
        recs = read_metrics(r.run_dir / "metrics.jsonl")
        losses = [x["loss"] for x in recs if x["split"] == "train"]
        assert len(losses) == 2 and all(0 < x < 20 for x in losses)
        runs[coef] = losses, aux.seen, r.final_dir
    (with_aux, seen, final), (without, seen_0, _) = runs[0.5], runs[0.0]
    assert len(seen) == len(seen_0) == 2 and seen[0] == pytest.approx(seen_0[0], rel=1e-5)
    assert with_aux[0] - without[0] == pytest.approx(0.5 * seen[0], rel=1e-3)
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(str(final))
    before, after = _router_weights(start), _router_weights(trained)
    assert before and all(not torch.equal(before[n], after[n]) for n in before)
