"""Generation: batching, static cache + compile, stop strings, seeded sampling, and the CLI."""

from __future__ import annotations

import io
import json

import pytest

from onegpu.cli.generate import cli, read_prompts_file
from onegpu.cli.main import main
from onegpu.errors import ConfigError, DataError
from onegpu.infer import InferConfig, SamplingConfig, generate, load

PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):\n    print(i"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(InferConfig(model=str(tiny_model_dir)))


def greedy(n: int = 12, **kw) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=n, greedy=True, **kw)


def _texts(completions):
    return [c.text for c in completions]


def test_batched_equals_one_by_one(tiny):
    batched = generate(tiny.model, tiny.tokenizer, PROMPTS, greedy(batch_size=3))
    single = generate(tiny.model, tiny.tokenizer, PROMPTS, greedy(batch_size=1))
    assert _texts(batched) == _texts(single)
    assert all(c.new_tokens > 0 and c.text for c in batched)


def test_compiled_decode_matches_eager_greedy_on_both_decoders(tiny):
    from torch._dynamo.utils import counters

    eager = generate(tiny.model, tiny.tokenizer, PROMPTS[:2], greedy(batch_size=2))
    counters.clear()
    # aot_eager traces and compiles the same graph as inductor, without inductor's C++ build time
    compiled = generate(
        tiny.model,
        tiny.tokenizer,
        PROMPTS[:2],
        greedy(batch_size=2, compile="default", compile_backend="aot_eager"),
    )
    assert _texts(compiled) == _texts(eager)
    assert counters["stats"]["unique_graphs"] >= 1  # the engine's step went through torch.compile
    hf = generate(
        tiny.model,
        tiny.tokenizer,
        PROMPTS[:2],
        greedy(batch_size=2, decoder="hf", compile="default", compile_backend="aot_eager"),
    )
    assert _texts(hf) == _texts(eager)
    assert hasattr(tiny.model, "_compiled_call")  # transformers' static-cache compile path ran


def test_stop_strings_cut_generation(tiny):
    full = generate(tiny.model, tiny.tokenizer, PROMPTS[:1], greedy(24))[0]
    assert full.finish_reason == "length" and len(full.text) > 6
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    expected = full.text[: full.text.find(stop)]
    cut = generate(tiny.model, tiny.tokenizer, PROMPTS[:1], greedy(24, stop=[stop]))[0]
    assert cut.text == expected and cut.finish_reason == "stop"
    assert cut.new_tokens < full.new_tokens  # generation itself stopped early, not just the text


def test_seeded_sampling_is_reproducible(tiny):
    def sample(seed):
        return _texts(
            generate(
                tiny.model,
                tiny.tokenizer,
                PROMPTS,
                SamplingConfig(max_new_tokens=10, seed=seed, temperature=1.5, top_k=0),
            )
        )

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_prompt_longer_than_context_is_a_clear_error(tiny):
    long = "x = 1\n" * 400  # > 256 positions of the tiny model
    with pytest.raises(DataError, match=r"prompt 2 is \d+ tokens; the model's context is 256"):
        generate(tiny.model, tiny.tokenizer, ["ok", long], greedy())
    with pytest.raises(DataError, match="prompt 1 is empty"):
        generate(tiny.model, tiny.tokenizer, ["  "], greedy())
    with pytest.raises(ConfigError, match="top_p"):
        generate(tiny.model, tiny.tokenizer, ["ok"], SamplingConfig(top_p=0))


def test_cli_generates_from_args_file_and_stdin(tmp_path, tiny_model_dir, monkeypatch, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr("sys.stdin", io.StringIO("x = 1\n\n"))
    args = [
        "--model",
        str(tiny_model_dir),
        "--greedy",
        "true",
        "--max_new_tokens",
        "6",
        "--output",
        str(out),
    ]
    assert cli(args + ["--prompts_file", str(prompts), "def f(", "-"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["def f(", "x = 1", *PROMPTS[:2]]
    assert all(r["new_tokens"] == 6 and r["finish_reason"] == "length" for r in records)
    assert records[0]["prompt"] + records[0]["text"] in capsys.readouterr().out


class _Stdout(io.StringIO):
    """sys.stdout that notes, at each write, how many forwards the model had run by then."""

    def __init__(self, forwards: list):
        super().__init__()
        self.forwards, self.writes = forwards, []

    def write(self, text):
        self.writes.append((text, len(self.forwards)))
        return super().write(text)

    def isatty(self):
        return False


def test_cli_streams_a_single_prompt(tiny_model_dir, monkeypatch):
    """--stream prints the text as it is made: pieces written while the model still runs forwards,
    together the greedy completion."""
    import torch

    forwards = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: (
            forwards.append(1) if type(m).__name__.endswith("ForCausalLM") else None
        )
    )
    out = _Stdout(forwards)
    monkeypatch.setattr("sys.stdout", out)
    argv = ["--model", str(tiny_model_dir), "--greedy", "true", "--max_new_tokens", "24"]
    try:
        assert cli([*argv, "--stream", "true", "def f("]) == 0
    finally:
        hook.remove()
    done = len(forwards)
    tiny = load(InferConfig(model=str(tiny_model_dir)))
    text = generate(tiny.model, tiny.tokenizer, ["def f("], greedy(24))[0].text
    pieces = [(t, n) for t, n in out.writes if t not in ("", "\n")]
    assert pieces[0][0] == "def f(" and "".join(t for t, _ in pieces[1:]) == text
    early = [t for t, n in pieces[1:] if n < done]  # text out before the last forward ran
    assert early and len(pieces) > 2, out.writes


def test_cli_errors_are_clear(tmp_path, tiny_model_dir, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="contains no prompts"):
        read_prompts_file(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl line 2"):
        read_prompts_file(str(bad))
    assert main(["generate", "--model", str(tmp_path / "missing"), "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dir), "--prompts_file", str(empty)]) == 2
    assert "contains no prompts" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dir)]) == 2
    assert "no prompts given" in capsys.readouterr().err


def test_cli_stop_flag_repeats_and_understands_backslash_n(tiny_model_dir, monkeypatch):
    seen = {}
    monkeypatch.setattr(
        "onegpu.cli.generate.run",
        lambda icfg, scfg, *rest: seen.setdefault("stop", scfg.stop) and 0,
    )
    cli(
        [
            "--model",
            str(tiny_model_dir),
            "--stop",
            r"\n\n",
            "--stop=return",
            "--stop",
            "a,b",
            "def f(",
        ]
    )
    assert seen["stop"] == ["\n\n", "return", "a,b"]


def test_quantization_without_bitsandbytes_names_generates_own_flags(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    """Where bitsandbytes cannot be imported, `generate --quantization nf4` names its own flag and
    a way round it, not training's techniques.lora.quantize_base (which generate refuses)."""
    import sys

    for name in [m for m in sys.modules if m == "bitsandbytes" or m.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, name)
    pkg = tmp_path / "site" / "bitsandbytes"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import onegpu_missing_cuda_runtime\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert main(["generate", "--model", str(tiny_model_dir), "--quantization", "nf4", "hi"]) == 2
    err = capsys.readouterr().err
    assert "bitsandbytes (for --quantization nf4) is installed but fails to import" in err
    assert "--quantization none" in err and "quantize_base" not in err
