"""The Ollama Modelfile: its TEMPLATE renders the model's chat template (rendered here by a Go
template renderer and compared with transformers' rendering), the file follows Ollama's documented
grammar, stop tokens and sampling defaults come from the model; and the GGUF's tokenizer facts
(pre-tokenizer name, end-of-turn ids) decided from the tokenizer files."""

from __future__ import annotations

import json

import pytest

from onegpu.export.gguf import TokenizerFacts, end_of_turn_ids
from onegpu.export.go_template import TemplateError, render
from onegpu.export.modelfile import ModelfileError, validate_modelfile
from onegpu.export.ollama import PROBE, go_template, write_ollama
from onegpu.export.pretokenizer import decide

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    PROBE,
    [{"role": "user", "content": "one"}],
    [
        {"role": "user", "content": 'a {{ brace }} and "quotes"\nnewline'},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
]


@pytest.mark.parametrize("template", [None, CHATML], ids=["onegpu", "chatml"])
def test_the_modelfile_template_renders_what_the_chat_template_does(tiny_tokenizer, template):
    tok = tiny_tokenizer
    saved = tok.chat_template
    try:
        if template:
            tok.chat_template = template
        go, why = go_template(tok)
        assert go is not None, why
        for messages in CONVERSATIONS:
            want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert render(go, messages) == want
    finally:
        tok.chat_template = saved


def test_a_template_that_is_not_one_text_per_message_is_left_to_the_gguf(tiny_tokenizer):
    saved = tiny_tokenizer.chat_template
    try:
        tiny_tokenizer.chat_template = (
            "{% for m in messages %}{{ loop.index }}: {{ m['content'] }}\n{% endfor %}"
        )
        go, why = go_template(tiny_tokenizer)
    finally:
        tiny_tokenizer.chat_template = saved
    assert go is None and "numbers turns" in why


def test_the_go_renderer_follows_go_syntax_and_refuses_what_it_does_not_know():
    msgs = [{"role": "user", "content": "x"}]
    assert (
        render('  {{- range .Messages }}  {{ .Role -}}  : {{ "lit" }}{{ end }}', msgs)
        == "  user: lit"
    )
    with pytest.raises(TemplateError, match="not closed"):
        render("{{ range .Messages }}{{ .Content }}", msgs)
    with pytest.raises(TemplateError, match="unsupported action"):
        render("{{ range .Messages }}{{ .Images }}{{ end }}", msgs)


def test_modelfile_written_follows_ollamas_grammar(tmp_path, tiny_tokenizer):
    gguf = tmp_path / "gguf" / "model-q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40})
    )
    facts = TokenizerFacts("gpt-2", "", False, end_of_turn_ids(tiny_tokenizer))
    folder = write_ollama(tmp_path / "ollama", gguf, tiny_tokenizer, merged, facts)
    text = (folder / "Modelfile").read_text()
    parsed = validate_modelfile(text)
    assert parsed[0] == ("FROM", "./model-q8_0.gguf") and (folder / gguf.name).is_file()
    names = [name for name, _ in parsed]
    assert names.count("TEMPLATE") == 1
    params = [arg for name, arg in parsed if name == "PARAMETER"]
    assert params == ['stop "<|eos|>"', "temperature 0.7", "top_p 0.9", "top_k 40"]


def test_modelfile_grammar_errors_name_the_line():
    with pytest.raises(ModelfileError, match="line 2: unknown parameter 'temprature'"):
        validate_modelfile("FROM ./m.gguf\nPARAMETER temprature 0.5\n")
    with pytest.raises(ModelfileError, match="no FROM"):
        validate_modelfile("PARAMETER top_k 4\n")
    with pytest.raises(ModelfileError, match="never closed"):
        validate_modelfile('FROM ./m.gguf\nTEMPLATE """{{ .Prompt }}\n')
    with pytest.raises(ModelfileError, match="top_k takes int"):
        validate_modelfile("FROM ./m.gguf\nPARAMETER top_k many\n")


def test_end_of_turn_is_what_the_template_writes_after_an_answer(tiny_tokenizer):
    tok = tiny_tokenizer
    assert end_of_turn_ids(tok) == [tok.eos_token_id]  # onegpu's template ends answers with EOS
    saved = tok.chat_template
    try:
        tok.chat_template = CHATML.replace("<|im_end|>", "<|end|>")
        assert end_of_turn_ids(tok) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
    finally:
        tok.chat_template = saved


def test_pre_tokenizer_is_decided_from_tokenizer_json(tmp_path, tiny_tokenizer):
    tiny_tokenizer.save_pretrained(str(tmp_path))
    assert decide(tmp_path)[0] == "gpt-2"
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    name, why = decide(tmp_path)
    assert name is None and "NFC normalizer" in why
