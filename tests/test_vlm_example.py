"""The shipped vision-language example (examples/shapes/): what ``python -m onegpu.shapes`` writes,
and `onegpu train` runs on it offline from one command, then `onegpu generate --image` answers
with the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLE = Path(__file__).parent.parent / "examples" / "shapes"


def test_the_shipped_example_is_what_the_generator_writes(tmp_path):
    from PIL import Image

    from onegpu import shapes

    lines = EXAMPLE.joinpath("train.jsonl").read_text().splitlines()
    made = shapes.write_dataset(tmp_path, n=len(lines), seed=0)
    assert made.read_text().splitlines() == lines
    for line in lines:
        name = json.loads(line)["messages"][0]["content"][0]["image"]
        shipped, again = Image.open(EXAMPLE / name), Image.open(tmp_path / name)
        assert shipped.convert("RGB").tobytes() == again.convert("RGB").tobytes(), name


def test_train_runs_offline_on_the_example_and_generate_reads_its_images(tmp_path, capsys):
    from onegpu import shapes
    from onegpu.cli.main import main

    model = shapes.tiny_vlm(tmp_path / "tiny-vlm")
    argv = ["train", "--model", str(model), "--data.path", str(EXAMPLE / "train.jsonl")]
    argv += ["--data.seq_len", "64", "--data.pad_to_multiple", "8", "--data.val_fraction", "0"]
    argv += ["--training.micro_batch_size", "8", "--training.max_steps", "2"]
    argv += ["--training.eval_every", "0", "--techniques.compile", "off"]
    argv += ["--output.dir", str(tmp_path / "runs"), "--output.name", "shapes"]
    argv += ["--output.report_to", "none"]
    assert main(argv) == 0
    out = tmp_path / "out.jsonl"
    image = EXAMPLE / "images" / "00000.png"
    argv = ["generate", "--model", str(tmp_path / "runs" / "shapes"), "--image", str(image)]
    argv += ["--greedy", "true", "--max_new_tokens", "4", "--output", str(out)]
    assert main([*argv, shapes.QUESTION]) == 0
    capsys.readouterr()
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["prompt"] == shapes.QUESTION and record["new_tokens"] >= 1
