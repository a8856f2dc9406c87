"""Vision-language models through the text loop: each family of the zoo (tests/vlm_zoo.py) trains
and reloads, its loss counts the answer only (token by token), its batches keep each example's
images, and techniques.vision decides what trains."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import IGNORE
from vlm_zoo import FAMILIES, save_tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """family -> a saved tiny model folder, built on first use."""
    root = tmp_path_factory.mktemp("vlm-zoo")
    made: dict = {}

    def get(family: str):
        if family not in made:
            made[family] = save_tiny_vlm(family, root / family)
        return made[family]

    return get


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory):
    from onegpu import shapes

    return shapes.write_dataset(tmp_path_factory.mktemp("shapes"), n=12)


def run_cfg(model, data, tmp_path, steps=2, **techniques):
    return {
        "model": {"name": str(model)},
        "data": {
            "path": str(data),
            "seq_len": 128,
            "num_proc": 1,
            "val_fraction": 0.0,
            "pad_to_multiple": 8,
        },
        "training": {
            "micro_batch_size": 2,
            "max_steps": steps,
            "lr": 1e-2,
            "warmup_steps": 0,
            "eval_every": 0,
            "log_every": 1,
            "seed": 0,
        },
        "techniques": {"compile": "off", **techniques},
        "output": {"dir": str(tmp_path / "runs"), "name": "r", "report_to": "none"},
    }


def weights(folder) -> dict:
    from helpers import weights as read

    return read(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_and_reloads_with_its_processor(family, zoo, shapes_data, tmp_path):
    from transformers import AutoModelForImageTextToText

    from onegpu import train, vlm

    start = zoo(family)
    final = train(run_cfg(start, shapes_data, tmp_path)).final_dir
    proc = vlm.load_processor(str(final))
    assert type(proc).__name__ == type(vlm.load_processor(str(start))).__name__
    model = AutoModelForImageTextToText.from_pretrained(str(final))
    before, after = weights(start), weights(final)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed  # it trained, and what was saved is what reloads:
    model.save_pretrained(str(tmp_path / "again"))
    again = weights(tmp_path / "again")
    assert again.keys() == after.keys()
    assert all(torch.equal(again[k], after[k]) for k in after)


def _conversation(image_part):
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [image_part, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "a red circle"},
        {"role": "user", "content": "And its colour?"},
        {"role": "assistant", "content": "red"},
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_counts_the_answers_only_token_by_token(family, zoo, tmp_path):
    """The labelled tokens are exactly each assistant turn's reply and its EOS, in order; no image
    placeholder, system or user token is a target."""
    from PIL import Image

    from onegpu import vlm
    from onegpu.config import DataConfig
    from onegpu.data import overlong
    from onegpu.data.vision import Encoder, image_token_ids

    proc = vlm.load_processor(str(zoo(family)))
    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "a.png")
    image = Image.open(tmp_path / "a.png").convert("RGB")
    conv = _conversation({"type": "image"})
    enc = Encoder(proc, DataConfig(seq_len=512))
    ids, turn, _ = enc.encode(conv, [image])
    labels = overlong.labelled(ids, turn)
    tok = proc.tokenizer
    want = []
    for reply in ("a red circle", "red"):
        want += tok(reply + tok.eos_token, add_special_tokens=False)["input_ids"]
    got = [t for t in labels if t != IGNORE]
    assert got == want
    masked = image_token_ids(proc)
    assert any(t in masked for t in ids)  # the image became tokens ...
    assert all(
        lab == IGNORE for t, lab in zip(ids, labels, strict=True) if t in masked
    )  # ... unlabelled
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    starts = [k for k in range(1, len(labels)) if labels[k] != IGNORE and labels[k - 1] == IGNORE]
    assert [ids[k - 1] for k in starts] == [
        assistant,
        assistant,
    ]  # each run starts after the marker


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_keeps_each_examples_own_images(family, zoo, tmp_path):
    """The summed loss of a padded batch of two examples equals the sum of each alone (so no
    example reads the other's image features), and it changes when the images are swapped."""
    from transformers import AutoModelForImageTextToText

    from onegpu import vlm
    from onegpu.config import DataConfig
    from onegpu.data.vision import VisionCollator, tokenize_counted
    from onegpu.objectives.tokens import TokenLoss

    folder = tmp_path / "d"
    (folder / "img").mkdir(parents=True)
    from PIL import Image

    lines = []
    for i, (colour, text) in enumerate([((220, 30, 30), "a red one"), ((30, 30, 220), "blue")]):
        Image.new("RGB", (32, 32), colour).save(folder / "img" / f"{i}.png")
        user = [{"type": "image", "image": f"img/{i}.png"}, {"type": "text", "text": "colour?"}]
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": text},
                    ]
                }
            )
        )
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    import datasets

    from onegpu.data.records import ORIGIN

    ds = datasets.load_dataset("json", data_files=str(folder / "data.jsonl"))["train"]
    ds = ds.add_column(ORIGIN, [f"{folder / 'data.jsonl'}:{i + 1}" for i in range(2)])
    proc = vlm.load_processor(str(zoo(family)))
    cfg = DataConfig(seq_len=256, pad_to_multiple=8)
    examples, _ = tokenize_counted(ds, proc, cfg, "train")
    rows = [examples[i] for i in range(2)]
    collate = VisionCollator(proc, cfg)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(zoo(family))).eval()
    loss = TokenLoss()

    def summed(batch):
        with torch.no_grad():
            return float(loss.loss_sum(model, batch)[1])

    both = collate(rows)
    assert (both["labels"][both["attention_mask"] == 0] == IGNORE).all()  # padding never counts
    alone = summed(collate(rows[:1])) + summed(collate(rows[1:]))
    assert summed(both) == pytest.approx(alone, rel=1e-4)
    swapped = [{**rows[0], "images": rows[1]["images"]}, {**rows[1], "images": rows[0]["images"]}]
    assert summed(collate(swapped)) != pytest.approx(summed(both), rel=1e-4)
