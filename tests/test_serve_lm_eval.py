"""lm-evaluation-harness against `onegpu serve`, live on loopback, on local tasks (a JSONL file and
task YAMLs written here: no hub): its `local-completions` backend, with token-id prompts (batched,
two connections) and with text prompts, gives the loglikelihoods, the per-item accuracy and the
greedy generations that its `hf` backend gives on the same saved model. The server is lm-eval's
tokenizer too (/tokenizer_info, /tokenize, /detokenize): nothing is loaded on the client's side.

Tolerance: both sides run the model in fp32 on the CPU, HF's forward over the whole sequence and
the engine's chunked prefill over its paged KV, so the same logits come out of differently ordered
sums. fp32 rounds at 6e-8 of a value; a token's log-softmax (logits of magnitude ~10 over a
512-token vocabulary) differs by a few units of that, and a text sums up to ~40 of them: measured
here, at most 1.1e-5 nats on sums of 18 to 135 (1.1e-7 of the value). rel=1e-6 with abs=2e-5
allows about ten times that; a token read off by one position, a wrong first token (the rolling
windows' BOS) or the last, generated, token summed in moves a sum by 0.4 nats or more."""

from __future__ import annotations

import json

import pytest

from serve_support import Server
from test_serve import KEY

lm_eval = pytest.importorskip("lm_eval")

CHOICES = ["yes", " no", " the value of a", " b) return"]
TASKS = ["tiny_choice", "tiny_gen", "tiny_rolling"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Three local tasks over one JSONL file, one per request kind lm-eval sends: loglikelihood
    (multiple choice), generate_until (greedy, stopped at a newline) and loglikelihood_rolling
    (a whole text from the BOS, which the server's /tokenizer_info names)."""
    import yaml

    root = tmp_path_factory.mktemp("lm-eval-tasks")
    items = [
        {
            "question": f"def add(a, b): return a + {i} is",
            "text": f"x = {i}\nreturn x",
            "label": i % 4,
        }
        for i in range(6)
    ]
    (root / "items.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    data = {"test": str(root / "items.jsonl")}
    base = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": data, "cache_dir": str(root / "datasets")},
        "test_split": "test",
    }
    yamls = {
        "tiny_choice": {
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": json.dumps(CHOICES),
            "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc"}],
        },
        "tiny_gen": {
            "output_type": "generate_until",
            "doc_to_text": "{{question}}",
            "doc_to_target": "{{text}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}],
        },
        "tiny_rolling": {
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{question}} {{text}}",
            "metric_list": [{"metric": "word_perplexity"}],
        },
    }
    for name, fields in yamls.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**base, "task": name, **fields}))
    from lm_eval.tasks import TaskManager

    # only these: indexing lm-eval's thousands of built-in task files costs 9 CPU seconds
    return TaskManager(include_path=str(root), include_defaults=False)


@pytest.fixture(scope="module")
def hf_samples(tiny_model_dir, tasks):
    """lm-eval's own reference: its `hf` backend on the saved model, fp32 on the CPU."""
    args = f"pretrained={tiny_model_dir},dtype=float32,device=cpu"
    return _samples(lm_eval.simple_evaluate(model="hf", model_args=args, **_run(tasks)))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = ["--model", str(tiny_model_dir), "--api_key", KEY]
    srv = Server(args, tmp_path_factory.mktemp("lm-eval") / "log")
    yield srv
    srv.stop()


def _run(tasks) -> dict:
    return {"tasks": TASKS, "task_manager": tasks, "log_samples": True, "batch_size": 2}


def _samples(out: dict) -> dict:
    return {task: sorted(out["samples"][task], key=lambda s: s["doc_id"]) for task in TASKS}


# the slow tier: the first case carries the module's setup (lm-eval's hf run and a live server's
# start), 12-16 CPU seconds and 65-110 s of wall clock on the 2-core machine under load
@pytest.mark.slow
@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_local_completions_gives_the_hf_backends_loglikelihoods(
    server, tiny_model_dir, tiny_tokenizer, tasks, hf_samples, tokenized, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what local-completions sends as its key
    args = {
        "base_url": f"{server.url}/v1/completions",
        "model": str(tiny_model_dir),  # the served name: --model as given
        "num_concurrent": 2,
        "max_length": 256,
        "tokenized_requests": tokenized,
        # the rolling windows start from the BOS, as the hf backend's do: lm-eval reads a remote
        # tokenizer's prefix as `bos_token_id or eos_token_id`, which takes the tiny tokenizer's
        # BOS, id 0, for none and starts from its EOS
        "custom_prefix_token_id": tiny_tokenizer.bos_token_id,
        "auth_token": KEY,  # what its remote tokenizer sends
    }
    model_args = ",".join(f"{k}={v}" for k, v in args.items())
    model = lm_eval.api.registry.get_model("local-completions").create_from_arg_string(model_args)
    assert model.tokenizer_backend == "remote"  # /tokenizer_info and /tokenize answered its probe
    api = _samples(lm_eval.simple_evaluate(model=model, **_run(tasks)))

    for task in ("tiny_choice", "tiny_rolling"):
        assert len(api[task]) == len(hf_samples[task]) == 6
        for ours, ref in zip(api[task], hf_samples[task], strict=True):
            assert ours["doc_id"] == ref["doc_id"]
            got = [r[0] for r in ours["resps"]]
            want = [r[0] for r in ref["resps"]]
            if task == "tiny_choice":  # (loglikelihood, is_greedy) per choice
                assert [g[1] for g in got] == [w[1] for w in want]
                got, want = [g[0] for g in got], [w[0] for w in want]
                assert ours["acc"] == ref["acc"]
            assert got == pytest.approx(want, rel=1e-6, abs=2e-5), (task, ours["doc_id"])
    for ours, ref in zip(api["tiny_gen"], hf_samples["tiny_gen"], strict=True):
        assert ours["resps"] == ref["resps"]  # greedy: the same text, stopped at the same place
