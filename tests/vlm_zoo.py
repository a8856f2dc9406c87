"""Vision-language families as tiny models with their real processors: the VLM tests train each,
save it, and load it back through from_pretrained (no download). Each family: our test tokenizer
with the family's image tokens, the family's image processor (PIL: no torchvision here), its
processor class, a chat template that renders content parts with the family's placeholder, and a
config of a few thousand weights."""

from __future__ import annotations

from helpers import CORPUS

# renders string or list-of-parts content; an image part becomes IMG (the family's placeholder)
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}IMG{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}<|eos|>{% else %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SIDE = 32  # image side the tiny processors resize to
FAMILIES = ("llava", "llava_next", "gemma3", "idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _tokenizer(tokens: list[str], texts=()):
    from onegpu.data.tokenizer import train_tokenizer

    tok = train_tokenizer(list(CORPUS) + list(texts), 512, f"vlm-zoo-{len(texts)}")
    tok.add_tokens(tokens, special_tokens=True)
    return tok


def _text(tok, **kw) -> dict:
    return dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **kw,
    )


def _vision(**kw) -> dict:
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIDE,
        patch_size=8,
        **kw,
    )


def llava(texts=()):
    import transformers

    tok = _tokenizer(["<image>"], texts)
    ip = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}
    )
    # "full" keeps the CLS token of the tower's output: one placeholder more than patches
    proc = transformers.LlavaProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE.replace("IMG", "<image>"),
    )
    cfg = transformers.LlavaConfig(
        vision_config=_vision(model_type="clip_vision_model"),
        text_config=dict(model_type="llama", **_text(tok)),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    return proc, cfg


def gemma3(texts=()):
    import transformers

    marks = {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    }
    base = _tokenizer(list(marks.values()), texts)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        extra_special_tokens=marks,
    )
    ip = transformers.Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE})
    proc = transformers.Gemma3Processor(
        image_processor=ip,
        tokenizer=tok,
        image_seq_length=4,
        chat_template=TEMPLATE.replace("IMG", "<start_of_image>"),
    )
    ids = {k.replace("_token", "_token_id"): tok.convert_tokens_to_ids(v) for k, v in marks.items()}
    cfg = transformers.Gemma3Config(
        vision_config=_vision(model_type="siglip_vision_model"),
        text_config=dict(model_type="gemma3_text", head_dim=16, **_text(tok)),
        mm_tokens_per_image=4,
        **ids,
    )
    return proc, cfg


def idefics3(texts=()):
    import transformers

    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tok = _tokenizer(
        ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *grid], texts
    )
    ip = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * SIDE},
        max_image_size={"longest_edge": SIDE},
        do_image_splitting=False,
    )
    proc = transformers.Idefics3Processor(
        image_processor=ip,
        tokenizer=tok,
        image_seq_len=4,
        chat_template=TEMPLATE.replace("IMG", "<image>"),
    )
    cfg = transformers.Idefics3Config(
        vision_config=_vision(),
        text_config=dict(model_type="llama", **_text(tok)),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    return proc, cfg


def _qwen(texts, processor_cls, config_cls, text_type: str, vision: dict):
    import transformers

    from onegpu import vlm

    tok = _tokenizer(
        ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"], texts
    )
    ip = transformers.Qwen2VLImageProcessorPil(
        min_pixels=16 * 16,
        max_pixels=SIDE * SIDE,
        patch_size=8,
        merge_size=2,
        temporal_patch_size=2,
    )
    # no torchvision, no video processor: onegpu builds the processor image-only
    proc = vlm.build_processor(
        processor_cls,
        ip,
        tok,
        TEMPLATE.replace("IMG", "<|vision_start|><|image_pad|><|vision_end|>"),
    )
    cfg = config_cls(
        vision_config=dict(
            depth=2,
            hidden_size=64,
            num_heads=2,
            patch_size=8,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            **vision,
        ),
        text_config=dict(
            model_type=text_type,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
            **_text(tok),
        ),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    return proc, cfg


def qwen2_vl(texts=()):
    import transformers

    return _qwen(
        texts,
        transformers.Qwen2VLProcessor,
        transformers.Qwen2VLConfig,
        "qwen2_vl_text",
        {"embed_dim": 32, "mlp_ratio": 2},
    )


def qwen2_5_vl(texts=()):
    import transformers

    return _qwen(
        texts,
        transformers.Qwen2_5_VLProcessor,
        transformers.Qwen2_5_VLConfig,
        "qwen2_5_vl_text",
        {
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "window_size": 16,
            "fullatt_block_indexes": [1],
        },
    )


def save_tiny_vlm(family: str, path, texts=(), seed: int = 0):
    """A random tiny model of ``family`` and its processor, written with save_pretrained."""
    import torch
    import transformers

    proc, cfg = globals()[family](texts)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(cfg)
    with torch.no_grad():  # Gemma 3 starts its projector at zero: no image would reach the LM
        for p in model.parameters():
            if p.dim() > 1 and not p.any():
                p.normal_(0, 0.1)
    model.save_pretrained(str(path))
    proc.save_pretrained(str(path))
    return path


def qwen3_vl(texts=()):
    import transformers

    vision = {
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [1],
    }
    proc, cfg = _qwen(
        texts, transformers.Qwen3VLProcessor, transformers.Qwen3VLConfig, "qwen3_vl_text", vision
    )
    cfg.text_config.head_dim = 16
    cfg.text_config.rope_parameters = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    return proc, cfg


def llava_next(texts=()):
    import transformers

    tok = _tokenizer(["<image>"], texts)
    ip = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": SIDE},
        crop_size={"height": SIDE, "width": SIDE},
        image_grid_pinpoints=[[SIDE, SIDE], [SIDE, 2 * SIDE]],
    )
    proc = transformers.LlavaNextProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE.replace("IMG", "<image>"),
    )
    cfg = transformers.LlavaNextConfig(
        vision_config=_vision(model_type="clip_vision_model"),
        text_config=dict(model_type="llama", **_text(tok)),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_grid_pinpoints=[[SIDE, SIDE], [SIDE, 2 * SIDE]],
    )
    return proc, cfg
