"""`onegpu bench infer --workload edits` (bench/infer_edits.py): the copy rate, the simulated
prompt-lookup proposer, the timed engine arm, the guard on the speculative arm."""

from __future__ import annotations

import json

import pytest

from onegpu.bench import infer_edits
from onegpu.cli.main import main


def test_lookup_takes_the_longest_suffix_match_first():
    # the last three tokens (2, 3, 4) occur at 1..3: what follows them is proposed
    assert infer_edits.lookup([9, 2, 3, 4, 7, 8, 5, 2, 3, 4], k=2) == [7, 8]
    # only the last token matches (at 0 and 3): the earliest match, and no more than is there
    assert infer_edits.lookup([5, 1, 6, 5], k=4) == [1, 6, 5]
    assert infer_edits.lookup([1, 2, 3], k=4) == []  # 3 never occurred before


def test_simulated_acceptance_counts_the_agreeing_prefix_of_each_proposal():
    prompt = [10, 11, 12, 13, 14, 15]
    # a model copying the prompt: after its first token (from the prompt's forward), every step
    # proposes the next 4 prompt tokens and all are accepted, plus one of the step's own
    assert infer_edits.simulate_lookup(prompt, [10, 11, 12, 13, 14, 15]) == [4]
    # a new token breaks the match: nothing to propose after 99 (it never occurred before)
    assert infer_edits.simulate_lookup(prompt, [10, 11, 99, 12, 13]) == [1, 0, 1]


def test_copy_rate_is_the_share_of_reference_tokens_in_place():
    assert infer_edits.copy_rate([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert infer_edits.copy_rate([1, 9, 3], [1, 2, 3, 4]) == 0.5  # 1 and 3 of four
    assert infer_edits.copy_rate([], [1, 2]) == 0.0


def test_the_engine_arm_counts_its_tokens_and_decode_steps(tiny_model_dir):
    """Batch 1 plain decoding makes one token per decode step after the prompt's: the arm's count
    says exactly that, and its tokens are greedy generate's."""
    from onegpu.infer import InferConfig, load

    lm = load(InferConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32"))
    encoded = [([5, 6, 7, 8, 9, 10], [5, 6, 7, 2]), ([11, 12, 13], [11, 12, 13, 14, 15, 2])]
    engine = infer_edits.make_engine(lm.model, encoded, None, 4)
    run, tokens = infer_edits.run_tasks(engine, encoded)
    assert run["tokens"] == sum(len(t) for t in tokens) and run["tps"] > 0
    assert run["tokens_per_step"] == 1.0 and run["decode_steps"] == run["tokens"] - 2
    import torch

    for (prompt, ref), got in zip(encoded, tokens, strict=True):
        out = lm.model.generate(
            torch.tensor([prompt]), max_new_tokens=len(ref) + 8, do_sample=False
        )[0, len(prompt) :].tolist()
        assert got == out[: len(got)] and 1 <= len(got) <= len(ref) + 8
    summary = infer_edits.copying(tokens, encoded)
    want = sum(infer_edits.copy_rate(g, r) for (_, r), g in zip(encoded, tokens, strict=True))
    assert summary["copy_rate"] == pytest.approx(want / 2)


def test_the_speculative_arm_runs_the_engine_with_it(tiny_model_dir):
    from onegpu.infer import InferConfig, load

    lm = load(InferConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32"))
    encoded = [([5, 6, 7], [5, 6, 2])]
    engine = infer_edits.make_engine(lm.model, encoded, "ngram", 4)
    assert engine.config.speculative == "ngram" and engine.config.num_speculative_tokens == 4
    assert infer_edits.make_engine(lm.model, encoded, None, 4).config.speculative is None


def test_speculative_without_the_edit_workload_is_refused(capsys):
    assert main(["bench", "infer", "--speculative", "ngram", "--dry_run", "true"]) == 2
    assert "fix: add --workload edits" in capsys.readouterr().err


@pytest.mark.slow
def test_the_edit_workload_end_to_end(tmp_path, tiny_tokenizer, capsys):
    """A random model (it copies nothing: exactness and timing only) through the CLI."""
    from helpers import make_tiny_llama

    model = tmp_path / "m"
    make_tiny_llama(tiny_tokenizer, max_position_embeddings=8192).save_pretrained(str(model))
    tiny_tokenizer.save_pretrained(str(model))
    argv = ["bench", "infer", "--workload", "edits", "--model", str(model), "--tasks", "1"]
    argv += ["--repeats", "2", "--device", "cpu", "--out", str(tmp_path), "--name", "e"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["rounds"] == 2 and [r["arm"] for r in result["rows"]] == ["engine"]
    assert result["rows"][0]["same_tokens"] and result["rows"][0]["tps"] > 0
    assert 0 <= result["copying"]["copy_rate"] <= 1
    assert "| engine |" in (tmp_path / "e.md").read_text()
