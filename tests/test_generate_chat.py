"""generate --chat: prompts as user turns through the tokenizer's chat template; auto turns it on
only for a model onegpu trained on chat data. Also the prompts file's JSON errors."""

from __future__ import annotations

import shutil

import pytest
import yaml

from onegpu.cli.generate import cli, read_prompts_file
from onegpu.errors import ConfigError, DataError
from onegpu.infer import InferConfig, SamplingConfig, generate, load


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    loaded = load(InferConfig(model=str(tiny_model_dir)))
    assert loaded.tokenizer.chat_template  # onegpu's trained tokenizers carry a chat template
    return loaded


def _fed(model, request) -> list:
    """Records the input_ids of each prefill (a forward of more than one token) the model runs."""
    seen = []

    def spy(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            seen.append(ids.tolist())

    request.addfinalizer(model.register_forward_pre_hook(spy, with_kwargs=True).remove)
    return seen


def _run_dir(tmp_path, tiny_model_dir, fmt: str):
    """A run directory as training leaves it: final/ and the config.yaml recording the data
    format."""
    shutil.copytree(tiny_model_dir, tmp_path / "run" / "final")
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"data": {"format": fmt}}))
    return tmp_path / "run"


def test_chat_feeds_exactly_the_chat_template_with_generation_prompt(tiny, request):
    seen = _fed(tiny.model, request)
    out = generate(
        tiny.model,
        tiny.tokenizer,
        ["def add(a, b):"],
        SamplingConfig(max_new_tokens=3, greedy=True, chat=True),
    )
    expected = tiny.tokenizer.apply_chat_template(
        [{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert seen == [[expected]]  # one call, one row
    assert (
        out[0].prompt == "def add(a, b):" and out[0].new_tokens == 3
    )  # the record keeps the user's prompt


def test_chat_batch_feeds_each_chat_template_whole_and_unpadded(tiny, request):
    seen = _fed(tiny.model, request)
    prompts = ["hi", "a longer question about Python classes"]
    generate(
        tiny.model,
        tiny.tokenizer,
        prompts,
        SamplingConfig(max_new_tokens=2, greedy=True, chat=True),
    )
    # the engine prefills each prompt in its own slot: no padding to line them up
    assert seen == [
        [
            tiny.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        ]
        for prompt in prompts
    ]


def test_chat_off_feeds_the_plain_prompt(tiny, request):
    seen = _fed(tiny.model, request)
    generate(
        tiny.model,
        tiny.tokenizer,
        ["def f("],
        SamplingConfig(max_new_tokens=2, greedy=True, chat=False),
    )
    assert seen == [tiny.tokenizer(["def f("])["input_ids"]]


def test_chat_auto_is_on_only_for_a_run_trained_on_chat_data(tmp_path, tiny_model_dir, request):
    chat_run = load(InferConfig(model=str(_run_dir(tmp_path / "a", tiny_model_dir, "messages"))))
    text_run = load(InferConfig(model=str(_run_dir(tmp_path / "b", tiny_model_dir, "text"))))
    plain = load(
        InferConfig(model=str(tiny_model_dir))
    )  # has a template, but no run says what it learnt
    assert (chat_run.data_format, text_run.data_format, plain.data_format) == (
        "messages",
        "text",
        None,
    )
    templated = chat_run.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    text = plain.tokenizer("hi")["input_ids"]
    for loaded, expected in ((chat_run, templated), (text_run, text), (plain, text)):
        seen = _fed(loaded.model, request)
        generate(
            loaded.model,
            loaded.tokenizer,
            ["hi"],
            SamplingConfig(max_new_tokens=1, greedy=True),
            data_format=loaded.data_format,
        )
        assert seen == [[expected]], loaded.data_format


def test_cli_chat_flag_reaches_generation(tmp_path, tiny_model_dir, monkeypatch):
    """Each call's settings reach the run: --chat as given (auto when not), the model under
    generate's name and under train's, and the prompt."""
    calls = []
    monkeypatch.setattr(
        "onegpu.cli.generate.run",
        lambda icfg, scfg, prompts, *rest: calls.append((icfg.model, scfg.chat, prompts)) or 0,
    )
    assert cli(["--model", str(tiny_model_dir), "--chat", "true", "hello"]) == 0
    assert cli(["--model.name", str(tiny_model_dir), "hi"]) == 0  # train's name for the model
    assert cli(["--model", str(tiny_model_dir), "--chat", "false", "yo"]) == 0
    model = str(tiny_model_dir)
    assert calls == [(model, True, ["hello"]), (model, "auto", ["hi"]), (model, False, ["yo"])]


def test_chat_without_a_template_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.setattr(tiny.tokenizer, "chat_template", None)
    with pytest.raises(
        ConfigError, match="--chat true needs a tokenizer with a chat template"
    ) as err:
        generate(tiny.model, tiny.tokenizer, ["hi"], SamplingConfig(max_new_tokens=1, chat=True))
    assert "--tokenizer" in err.value.hint


@pytest.mark.parametrize(
    "line, column", [('{"prompt": "unterminated', 12), ("{oops", 2), ('{"prompt": 1,}', 14)]
)
def test_prompts_file_json_error_names_line_and_column_without_a_dangling_at(
    tmp_path, line, column
):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n' + line + "\n")
    with pytest.raises(DataError) as err:
        read_prompts_file(str(bad))
    message = str(err.value).splitlines()[0]
    assert "bad.jsonl line 2: not valid JSON (" in message and f"at column {column})" in message
    assert " at at " not in message and " at)" not in message
