"""The shapes example: a vision-language dataset generated in code, and a tiny LLaVA to train on it
from scratch, so a first VLM run needs no download.

Each record is a picture of one coloured shape (circle, square or triangle, at a random place and
size on a grey background) with the question "What is in the picture?" and the caption "a <colour>
<shape>". Only the pixels tell the colour and the shape: a model that ignores the image is at
chance (1 / len(COLOURS) on the colour). ``python -m onegpu.shapes DIR`` writes DIR/train.jsonl and
DIR/images/, and with --model a tiny untrained LLaVA at DIR/tiny-vlm (docs/vlm.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What is in the picture?"
SIDE = 32  # image side in pixels: small enough to train on a CPU in minutes


def draw(colour: str, shape: str, rng: random.Random, side: int = SIDE):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (side, side), (128, 128, 128))
    d = ImageDraw.Draw(img)
    size = rng.randint(side // 3, side // 2)
    x, y = rng.randint(0, side - size), rng.randint(0, side - size)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse((x, y, x + size, y + size), fill=fill)
    elif shape == "square":
        d.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        d.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return img


def write_dataset(folder, n: int = 400, seed: int = 0, blank: bool = False) -> Path:
    """``n`` records in folder/train.jsonl, their images in folder/images/ (paths relative to the
    data file). ``blank``: every image plain grey (the control run: nothing to read)."""
    from PIL import Image

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        img = draw(colour, shape, rng)
        if blank:
            img = Image.new("RGB", img.size, (128, 128, 128))
        name = f"images/{i:05d}.png"
        img.save(folder / name)
        user = [{"type": "image", "image": name}, {"type": "text", "text": QUESTION}]
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": caption(colour, shape)},
        ]
        lines.append(json.dumps({"messages": messages}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def caption(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


# A chat template that renders content parts, the image part as LLaVA's placeholder; assistant
# turns end with EOS (the model learns to stop).
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{% if m['role'] == 'assistant' %}<|eos|>{% else %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_vlm(folder, seed: int = 0, hidden: int = 64) -> Path:
    """An untrained LLaVA (a 2-layer CLIP vision tower on 8x8 patches, a 2-layer Llama) with a
    tokenizer trained on the captions, and its processor, written with save_pretrained."""
    import torch
    import transformers

    from onegpu.data.tokenizer import train_tokenizer

    texts = [QUESTION] + [caption(c, s) for c in COLOURS for s in SHAPES]
    tok = train_tokenizer(texts * 20, 320, "shapes-v1")
    tok.add_tokens(["<image>"], special_tokens=True)
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,  # "full" keeps the tower's CLS token
        chat_template=TEMPLATE,
    )
    text = dict(
        model_type="llama",
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=SIDE,
        patch_size=8,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    folder = Path(folder)
    model.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    return folder


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m onegpu.shapes", description=__doc__.split("\n")[0])
    p.add_argument("folder", help="where to write train.jsonl and images/")
    p.add_argument("-n", type=int, default=400, help="records (default 400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model", action="store_true", help="also write a tiny LLaVA to FOLDER/tiny-vlm"
    )
    a = p.parse_args(argv)
    data = write_dataset(a.folder, a.n, a.seed)
    print(f"wrote {a.n} records to {data}")
    if a.model:
        print(f"wrote a tiny LLaVA to {tiny_vlm(Path(a.folder) / 'tiny-vlm', a.seed)}")


if __name__ == "__main__":
    main()
