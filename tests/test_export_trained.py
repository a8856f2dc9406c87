"""Exports of trained runs, end to end through llama.cpp: a chat SFT run that stops after its
answer in `onegpu generate --chat` stops in llama.cpp's own chat path too (the GGUF's template and
end-of-turn token, the same answer), and QLoRA runs of two families export merged into the base
reloaded in full precision, safetensors and GGUF both passing the check. Slow: training runs, and
llama.cpp (scripts/build_llama_cpp.sh) in `make test-all`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from families import tiny_family_model
from helpers import make_cfg
from llama_support import llama_cpp_ready, save  # noqa: F401 (a fixture)
from onegpu import train
from onegpu.export import ExportConfig, export
from onegpu.infer import InferConfig, SamplingConfig, generate, load

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "llama_cpp_ready")]
# Short answers a tiny model learns by heart in 30 steps, each then ended by the template's EOS
QA = [
    ("hi", "hello there"),
    ("add two numbers", "def add(a, b):\n    return a + b"),
    ("print squares", "for i in range(10):\n    print(i * i)"),
    ("a fox", "The quick brown fox."),
    ("join a path", "os.path.join('a', 'b')"),
]
MAX_NEW = 40

# llama.cpp's own chat path (llama-cpp-python's create_chat_completion: the GGUF's
# tokenizer.chat_template rendered with its add_generation_prompt, generation ended by the
# vocabulary's end-of-generation tokens), in a child process as the export's check runs it
CHAT_CHILD = """
import json, sys
from llama_cpp import Llama
gguf, questions, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=gguf, n_ctx=256, verbose=False, seed=0)
out = []
for q in questions:
    r = llm.create_chat_completion([{"role": "user", "content": q}], temperature=0.0, max_tokens=n)
    text = r["choices"][0]["message"]["content"]
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    out.append({"text": text, "finish": r["choices"][0]["finish_reason"], "ids": ids,
                "completion_tokens": r["usage"]["completion_tokens"]})
print(json.dumps(out))
"""


def _chat_run(tmp_path, base_dir):
    data = tmp_path / "chat.jsonl"
    with data.open("w") as f:
        for i in range(60):
            q, a = QA[i % len(QA)]
            turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": turns}) + "\n")
    cfg = make_cfg(tmp_path, base_dir, name="chat", max_steps=30, eval_every=1000)
    cfg["training"].update(save_every=1000, warmup_steps=5, micro_batch_size=8, grad_accum=1)
    cfg["data"].update(path=str(data), seq_len=64)
    return train(cfg).run_dir


def test_a_chat_model_that_stops_in_generate_stops_in_llama_cpp(tmp_path, tiny_model_dir):
    run = _chat_run(tmp_path, tiny_model_dir)
    loaded = load(InferConfig(model=str(run)))
    questions = [q for q, _ in QA]
    scfg = SamplingConfig(max_new_tokens=MAX_NEW, greedy=True, chat=True)
    ours = generate(loaded.model, loaded.tokenizer, questions, scfg)
    # what is exported: a model that answers and then stops (EOS ends the template's turn)
    assert [o.text for o in ours] == [a for _, a in QA]
    assert all(o.finish_reason == "stop" and o.new_tokens < MAX_NEW for o in ours)

    out = tmp_path / "out"
    result = export(ExportConfig(model=str(run), output=str(out), format="gguf", quant="f16"))
    assert result.passed, result.summaries
    report = json.loads((out / "gguf" / "export-check.json").read_text())
    assert report["prompts"].startswith("validation data")  # chat turns of the run's own data
    gguf = out / "gguf" / "model-f16.gguf"
    done = subprocess.run(
        [sys.executable, "-c", CHAT_CHILD, str(gguf), json.dumps(questions), str(MAX_NEW)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    tok = loaded.tokenizer
    for o, t in zip(ours, theirs, strict=True):
        assert t["text"] == o.text and t["finish"] == "stop", (o, t)
        assert t["ids"] == tok(o.text, add_special_tokens=False)["input_ids"]
        # ended by the end-of-turn token after the answer, not by the length limit
        assert t["completion_tokens"] < MAX_NEW


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_qlora_run_exports_merged_in_full_precision_to_safetensors_and_gguf(
    tmp_path, tiny_tokenizer, text_file, family
):
    import torch

    from helpers import weights

    base = save(tiny_family_model(family, tiny_tokenizer), tiny_tokenizer, tmp_path / "base")
    cfg = {
        "model": {"name": str(base)},
        "data": {"path": str(text_file), "seq_len": 32, "num_proc": 1},
        "training": {"micro_batch_size": 2, "max_steps": 8, "eval_every": 0, "lr": 5e-2},
        "techniques": {
            "lora": {"enabled": True, "r": 8, "alpha": 16, "quantize_base": "nf4"},
            "checkpointing": "full",
        },
        "output": {"dir": str(tmp_path), "name": "run", "report_to": "none"},
    }
    run = train(cfg).run_dir
    assert (run / "final" / "adapter_config.json").is_file()
    out = tmp_path / "out"
    said = []
    ecfg = ExportConfig(model=str(run), output=str(out), format="safetensors,gguf", quant="q8_0")
    result = export(ecfg, say=said.append)
    assert result.passed, result.summaries
    assert any("QLoRA run" in s and "never into its 4-bit weights" in s for s in said)
    merged, original = weights(out / "safetensors"), weights(base)
    assert not any("lora" in k or "absmax" in k or "quant" in k for k in merged)
    q = next(k for k in merged if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert merged[q].dtype == torch.float32  # merged in full precision, not 4-bit
    assert not torch.equal(merged[q], original[q])  # the adapter's update is in the weights
    gguf = json.loads((out / "gguf" / "export-check.json").read_text())
    assert gguf["status"] == "passed" and gguf["format"] == "gguf q8_0"
