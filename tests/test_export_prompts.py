"""Where the export's check takes its prompts from: a run folder's validation records, rendered as
training rendered them (chat turns through the template up to the last assistant turn); a plain
model folder or --prompts otherwise. The report and the summary line say which."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from helpers import make_cfg
from onegpu.export import ExportConfig, export

pytestmark = pytest.mark.usefixtures("one_thread")


def _chat_run(tmp_path, tiny_model_dir):
    """A run folder as training leaves it (final/ and config.yaml) over chat records that each
    say something different, so the check's prompts can be traced to their records."""
    data = tmp_path / "chat.jsonl"
    with data.open("w") as f:
        for i in range(40):
            conv = [
                {"role": "user", "content": f"what is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}"},
            ]
            f.write(json.dumps({"messages": conv}) + "\n")
    cfg = make_cfg(tmp_path, tiny_model_dir)
    cfg["data"]["path"] = str(data)
    run = tmp_path / "runs" / "chat"
    shutil.copytree(tiny_model_dir, run / "final")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run, cfg


def test_a_run_folder_checks_on_its_validation_records_rendered_as_trained(
    tmp_path, tiny_model_dir, tiny_tokenizer
):
    from onegpu.config import DataConfig, from_dict
    from onegpu.data.records import load_records

    run, cfg = _chat_run(tmp_path, tiny_model_dir)
    said = []
    result = export(ExportConfig(model=str(run), check_tokens=8), say=said.append)
    assert result.passed
    report = json.loads((run / "export" / "safetensors" / "export-check.json").read_text())
    assert report["prompts"].startswith("validation data (4 records of")
    assert "rendered as training rendered them" in report["reference"]
    # the records training held out (its own split, its seed), not training records
    _, val, _ = load_records(from_dict(cfg["data"], DataConfig), cfg["training"]["seed"])
    held_out = [rec["messages"][0]["content"] for rec in val]
    asked = [r["prompt"] for r in report["results"]]
    assert asked == held_out[:4]
    summary = next(s for s in said if s.startswith("check safetensors"))
    assert summary.endswith("(prompts: " + report["prompts"] + ")")


def test_a_chat_record_is_rendered_up_to_its_last_assistant_turn(tiny_tokenizer):
    from onegpu.config import DataConfig
    from onegpu.export.prompts import render

    conv = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    text, ids = render({"messages": conv}, "messages", DataConfig(), tiny_tokenizer)
    want = tiny_tokenizer.apply_chat_template(conv[:4], tokenize=False, add_generation_prompt=True)
    assert text == "and 2+2?"
    assert ids == tiny_tokenizer(want, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids).endswith("<|user|>and 2+2?<|end|><|assistant|>")
    text, ids = render({"text": "x = 1\n" * 40}, "text", DataConfig(), tiny_tokenizer)
    assert (
        len(ids) == 32
        and ids == tiny_tokenizer("x = 1\n" * 40, add_special_tokens=False)["input_ids"][:32]
    )


def test_a_model_folder_uses_the_built_in_prompts_and_says_so(tmp_path, tiny_model_dir):
    from onegpu.export.prompts import BUILTIN_PROMPTS

    said = []
    out = tmp_path / "out"
    export(ExportConfig(model=str(tiny_model_dir), output=str(out), check_tokens=4), said.append)
    report = json.loads((out / "safetensors" / "export-check.json").read_text())
    assert report["prompts"] == "built-in"
    assert [r["prompt"] for r in report["results"]] == list(BUILTIN_PROMPTS)
    assert any(s.endswith("(prompts: built-in)") for s in said)
    cfg = ExportConfig(model=str(tiny_model_dir), output=str(out), force=True, prompts=["a b"])
    export(cfg, say=said.append)
    report = json.loads((out / "safetensors" / "export-check.json").read_text())
    assert report["prompts"] == "--prompts" and report["results"][0]["prompt"] == "a b"
