"""A vision-language model's records: the three ways to name an image give the same example, images
are read relative to the data file, and each bad input gets one error naming the record (or, under
data.on_bad_record=skip, is counted and left out)."""

from __future__ import annotations

import base64
import json

import pytest

from onegpu.errors import DataError
from vlm_zoo import save_tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return save_tiny_vlm("llava", tmp_path_factory.mktemp("llava"))


def write(folder, records, name="data.jsonl"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def image(path, colour=(200, 30, 30)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), colour).save(path)
    return path


def record(part, answer="a red square", **extra):
    user = [part, {"type": "text", "text": "What is it?"}]
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
        **extra,
    }


def build(model, data, **data_cfg):
    from onegpu.config import from_dict
    from onegpu.training.data import build_data

    d = {"path": str(data), "seq_len": 128, "num_proc": 1, "val_fraction": 0.0, **data_cfg}
    return build_data(from_dict({"model": {"name": str(model)}, "data": d}), str(model))


def test_image_parts_images_column_and_data_urls_give_the_same_example(llava, tmp_path):
    folder = tmp_path / "sub"
    png = image(folder / "img" / "a.png")
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    forms = {
        # a path relative to the data file, not to the working directory
        "part": record({"type": "image", "image": "img/a.png"}),
        "column": record({"type": "image"}, images=["img/a.png"]),
        "url": record({"type": "image_url", "image_url": {"url": url}}),
    }
    built = {k: build(llava, write(folder, [r] * 2, f"{k}.jsonl")) for k, r in forms.items()}
    ids = {k: b.train_ds[0]["input_ids"] for k, b in built.items()}
    assert ids["part"] == ids["column"] == ids["url"]
    assert built["part"].train_ds[0]["images"] == [str(png.resolve())]
    assert built["part"].processor is not None  # saved beside the weights at the end of a run


def test_a_missing_image_names_the_file_and_line(llava, tmp_path):
    image(tmp_path / "a.png")
    data = write(
        tmp_path,
        [
            record({"type": "image", "image": "a.png"}),
            record({"type": "image", "image": "gone.png"}),
        ],
    )
    with pytest.raises(DataError, match=r"data\.jsonl:2: image file '.*gone\.png' does not exist"):
        build(llava, data)


def test_a_corrupt_image_names_the_file_and_line(llava, tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    data = write(tmp_path, [record({"type": "image", "image": "bad.png"})])
    with pytest.raises(DataError, match=r"data\.jsonl:1: image file '.*bad\.png' cannot be read"):
        build(llava, data)


def test_on_bad_record_skip_counts_and_leaves_them_out(llava, tmp_path):
    image(tmp_path / "a.png")
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    good = record({"type": "image", "image": "a.png"})
    data = write(
        tmp_path,
        [
            good,
            record({"type": "image", "image": "gone.png"}),
            good,
            record({"type": "image", "image": "bad.png"}),
        ],
    )
    built = build(llava, data, on_bad_record="skip")
    assert len(built.train_ds) == 2
    assert built.stats[0].bad == 2
    assert "2 record(s) with a missing or unreadable image skipped" in built.stats[0].describe()


def test_more_images_than_placeholders_is_an_error(llava, tmp_path):
    image(tmp_path / "a.png")
    data = write(tmp_path, [record({"type": "image"}, images=["a.png", "a.png"])])
    with pytest.raises(
        DataError, match=r"data\.jsonl:1: 1 image\(s\) in the images column have no"
    ):
        build(llava, data)


def test_more_placeholders_than_images_is_an_error(llava, tmp_path):
    data = write(tmp_path, [record({"type": "image"})])
    with pytest.raises(DataError, match=r"data\.jsonl:1: image part 1 names no image"):
        build(llava, data)


def test_an_image_part_for_a_text_only_model_is_an_error(tiny_model_dir, tmp_path):
    image(tmp_path / "a.png")
    data = write(tmp_path, [record({"type": "image", "image": "a.png"})] * 2)
    with pytest.raises(DataError, match=r"data\.jsonl:\d: chat message 1 has an image part, but"):
        build(tiny_model_dir, data)


def test_images_over_what_a_sequence_holds_are_an_error(llava, tmp_path):
    image(tmp_path / "a.png")
    data = write(tmp_path, [record({"type": "image", "image": "a.png"})])
    # the tiny LLaVA's image is 17 tokens (16 patches and the tower's CLS)
    with pytest.raises(DataError, match=r"data\.jsonl:1: its 1 image\(s\) become 17 tokens"):
        build(llava, data, seq_len=16)


def test_max_pixels_on_a_processor_without_it_is_an_error(llava, tmp_path):
    image(tmp_path / "a.png")
    data = write(tmp_path, [record({"type": "image", "image": "a.png"})])
    with pytest.raises(DataError, match=r"data\.max_pixels=1024: CLIPImageProcessorPil has no"):
        build(llava, data, max_pixels=1024)


def test_max_pixels_sets_how_many_tokens_an_image_becomes(tmp_path):
    """Qwen2-VL's processor reads data.max_pixels: a 64x64 image resized to 32x32 is 16 patches
    of 8x8, merged 2x2 into 4 tokens; to 16x16, one token."""
    model = save_tiny_vlm("qwen2_vl", tmp_path / "qwen")
    from PIL import Image

    Image.new("RGB", (64, 64), (10, 200, 10)).save(tmp_path / "big.png")
    data = write(tmp_path, [record({"type": "image", "image": "big.png"})] * 2)

    def image_tokens(**kw):
        built = build(model, data, **kw)
        pad_id = built.processor.image_token_id
        return sum(t == pad_id for t in built.train_ds[0]["input_ids"])

    assert image_tokens(max_pixels=32 * 32) == 4
    assert image_tokens(max_pixels=16 * 16) == 1


def test_a_web_address_is_refused(llava, tmp_path):
    data = write(tmp_path, [record({"type": "image_url", "image_url": {"url": "https://x/a.png"}})])
    with pytest.raises(DataError, match="is a web address"):
        build(llava, data)


def test_loading_a_vision_language_model_gives_its_processor(llava):
    from transformers import LlavaForConditionalGeneration

    from onegpu.infer.loading import InferConfig, load

    loaded = load(InferConfig(model=str(llava)))
    assert isinstance(loaded.model, LlavaForConditionalGeneration)
    assert type(loaded.processor).__name__ == "LlavaProcessor"
    assert loaded.tokenizer is loaded.processor.tokenizer
