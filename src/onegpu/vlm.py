"""Vision-language models: tell one from a text model by its config, load it with transformers'
image-text-to-text class and its processor, and save the processor beside the weights.

The processor is transformers' own (its chat template, its image processor, its rules for how many
placeholder tokens an image becomes); nothing of its token expansion is repeated here. Without
torchvision, transformers falls back to its PIL image processors (``*ImageProcessorPil``) and its
video processors do not exist, so the processors of families that also read video (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, SmolVLM) cannot be built as they are (``VIDEO_PROCESSOR_MAPPING`` is a
placeholder without ``_extra_content``: transformers#43986, #48556). For those, ``load_processor``
builds the family's own processor class from its documented parts with no video processor: a
subclass that accepts ``video_processor=None`` and nothing else changed (``image_only``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from onegpu.errors import ModelError

log = logging.getLogger(__name__)

# The families trained and reloaded in the test zoo (tests/vlm_zoo.py), by config model_type.
FAMILIES = {
    "llava": "LLaVA",
    "llava_next": "LLaVA-NeXT",
    "gemma3": "Gemma 3",
    "idefics3": "Idefics3",
    "smolvlm": "SmolVLM",
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
}
# Families transformers ships that onegpu does not train, each with the reason.
UNSUPPORTED = {
    "mllama": "Mllama (Llama 3.2 Vision) feeds images through cross-attention layers with their "
    "own masks (cross_attention_mask, aspect-ratio tiles), which onegpu's batches do not build yet",
}


def is_vision_config(config) -> bool:
    """A composite config with a vision tower (LLaVA, Gemma 3, Qwen2-VL, ...): a text model has no
    vision_config."""
    return getattr(config, "vision_config", None) is not None


def check_family(config) -> None:
    """One clear error for a vision-language family onegpu cannot train."""
    kind = getattr(config, "model_type", "")
    if kind in UNSUPPORTED:
        raise ModelError(
            f"model type '{kind}' is not supported: {UNSUPPORTED[kind]}.",
            hint=f"use one of {', '.join(FAMILIES.values())}",
        )


def model_class():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


# ----------------------------------------------------------------------------------- processors
@functools.cache
def image_only(cls):
    """``cls`` (a processor class whose __init__ takes a video processor), accepting
    ``video_processor=None``: transformers checks each part's class, and without torchvision the
    video part's class cannot be looked up at all. Same name, same methods otherwise."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None  # image-only: no video processor exists without torchvision
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    def save_pretrained(self, save_directory, **kwargs):
        return save_parts(self, save_directory)

    return type(
        cls.__name__,
        (cls,),
        {
            "check_argument_for_proper_class": check_argument_for_proper_class,
            "save_pretrained": save_pretrained,
            "__doc__": f"{cls.__name__} without a video processor (no torchvision here).",
        },
    )


def takes_video(cls) -> bool:
    import inspect

    return "video_processor" in inspect.signature(cls.__init__).parameters


def build_processor(cls, image_processor, tokenizer, chat_template=None, **kwargs):
    """``cls(image_processor, tokenizer, ...)``, image-only where ``cls`` also reads video and no
    video processor can exist here."""
    if takes_video(cls) and not video_processors_available():
        return image_only(cls)(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )
    return cls(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs
    )


def video_processors_available() -> bool:
    import transformers

    return hasattr(transformers, "VideoProcessorMixin")  # exported only with torchvision


def load_processor(name: str, trust_remote_code: bool = False):
    """The model's processor: AutoProcessor where it builds, else the family's processor class from
    its parts (image processor, tokenizer, chat template) as ``build_processor`` makes it."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    cls = processor_class(config)
    if cls is None or not takes_video(cls) or video_processors_available():
        try:
            proc = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, ImportError) as exc:  # SmolVLM's needs num2words
            raise ModelError(
                f"cannot load the processor of '{name}': {str(exc).strip().splitlines()[0]}",
                hint="a vision-language model folder needs its processor files "
                "(preprocessor_config.json, the tokenizer, the chat template): save the "
                "processor with save_pretrained beside the model",
            ) from None
    else:
        from transformers import AutoTokenizer

        image_processor = AutoImageProcessor.from_pretrained(
            name, trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        extra = _processor_kwargs(name, cls)
        proc = build_processor(cls, image_processor, tokenizer, _chat_template(name), **extra)
    log.info(
        "processor: %s with %s (%s)",
        type(proc).__name__,
        type(proc.image_processor).__name__,
        "PIL: torchvision is not installed"
        if type(proc.image_processor).__name__.endswith("Pil")
        else "fast, torchvision",
    )
    return proc


def processor_class(config):
    """The processor class transformers pairs with ``config``'s model type, or None."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    return getattr(transformers, name, None) if isinstance(name, str) else None


def save_parts(processor, folder) -> None:
    """Write a processor that has no video processor as the files AutoProcessor and
    ``load_processor`` read: the tokenizer, the image processor (preprocessor_config.json, naming
    the processor class) and the chat template."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    processor.tokenizer.save_pretrained(str(folder))
    processor.image_processor.save_pretrained(str(folder))
    if processor.chat_template:
        (folder / "chat_template.jinja").write_text(processor.chat_template, encoding="utf-8")
    _write_processor_config(processor, folder)


def _write_processor_config(processor, folder: Path) -> None:
    import json

    keys = _init_keys(type(processor))
    config = {
        k: getattr(processor, k)
        for k in keys
        if isinstance(getattr(processor, k, None), (int, float, str, bool))
    }
    config["processor_class"] = type(processor).__name__
    (folder / "processor_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _init_keys(cls) -> list[str]:
    import inspect

    skip = {"self", "image_processor", "tokenizer", "video_processor", "chat_template", "kwargs"}
    return [k for k in inspect.signature(cls.__init__).parameters if k not in skip]


def _processor_kwargs(name: str, cls) -> dict:
    """The processor's own settings saved in processor_config.json (LLaVA's patch_size, ...)."""
    import json

    path = Path(name) / "processor_config.json"
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in saved.items() if k in _init_keys(cls)}


def _chat_template(name: str) -> str | None:
    """The processor's chat template: chat_template.jinja, else chat_template.json's, else the
    tokenizer's (AutoTokenizer reads that one)."""
    import json

    folder = Path(name)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get(
            "chat_template"
        )
    return None


# ------------------------------------------------------------------------------ the model's parts
def vision_modules(model) -> tuple[list[str], list[str]]:
    """(the vision tower's module names, the projector's) in ``model``, found by transformers'
    own names for them across families (LLaVA vision_tower / multi_modal_projector, Qwen2-VL
    visual (its merger is the projector), Idefics3 vision_model / connector, Gemma 3
    vision_tower / multi_modal_projector)."""
    tower, projector = [], []
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("multi_modal_projector", "connector") or name.endswith("visual.merger"):
            projector.append(name)
        elif leaf in ("vision_tower", "vision_model", "visual"):
            tower.append(name)
    return tower, projector
