"""Images in chat requests, OpenAI's ``image_url`` content parts, for a vision-language model:
data URLs always; a local file (a path, or a ``file://`` URL) only inside the folder given with
``--allowed_local_media``, as vLLM has it; a web address never (the server downloads nothing).
Any other part, a file outside that folder or an image that cannot be read is a 400 naming the
part (``messages[i].content[j]``).

Each image is read as training reads one (data/images.py), the messages are rendered with the
processor's chat template as in training (data/vision.py: an image part becomes the template's
``{"type": "image"}``), and the processor expands each image into its placeholder tokens beside
its pixel tensors (infer/images.py), which go to the engine with the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse

from onegpu.serve.chat_template import render_chat
from onegpu.serve.messages import ImagePart
from onegpu.serve.schemas import APIError


@dataclass(frozen=True)
class Media:
    """A server's reading of image parts."""

    processor: object = None
    """The vision-language model's processor; None: the model reads text only."""
    allowed: Optional[Path] = None
    """ServeConfig.allowed_local_media: the folder local images may be read from; None: none."""

    def prompt(self, req, tools: Optional[list]):
        """(token ids, PromptImages or None) of a chat request for a vision-language model, its
        image parts read; None for a text model's request (its tokenizer's template renders it)."""
        parts = [
            (f"messages[{i}].content[{j}]", p)
            for i, m in enumerate(req.messages)
            if isinstance(m.content, list)
            for j, p in enumerate(m.content)
            if isinstance(p, ImagePart)
        ]
        if self.processor is None:
            if parts:
                raise APIError(
                    400,
                    f"{parts[0][0]} is an image, and this server's model reads text only.",
                    param=parts[0][0],
                    code="image_unsupported",
                )
            return None
        images = [self._image(where, part.image_url.url) for where, part in parts]
        return self._encode([_for_template(m) for m in req.messages], images, tools)

    def _image(self, where: str, url: str):
        from onegpu.data.images import BadImage, open_image

        source = self._source(where, url)
        try:
            return open_image(source, where)
        except BadImage as exc:
            raise APIError(400, str(exc), param=where, code="invalid_image") from None

    def _source(self, where: str, url: str) -> str:
        """A data URL as it is; a local file's absolute path, inside the allowed folder."""
        if url.startswith("data:"):
            return url
        parsed = urlparse(url)
        if parsed.scheme not in ("", "file"):
            raise APIError(
                400,
                f"{where}: '{url[:80]}' is a web address; this server reads images from data "
                "URLs (and local files under --allowed_local_media), it downloads nothing.",
                param=where,
                code="invalid_image",
            )
        path = Path(unquote(parsed.path) if parsed.scheme == "file" else url).expanduser()
        if self.allowed is None:
            raise APIError(
                400,
                f"{where}: '{url[:80]}' is a local file; this server reads local images only "
                "when started with --allowed_local_media DIR (then from inside DIR). Send the "
                "image as a data URL instead.",
                param=where,
                code="invalid_image",
            )
        root = self.allowed.expanduser().resolve()
        path = (path if path.is_absolute() else root / path).resolve()
        if not path.is_relative_to(root):
            raise APIError(
                400,
                f"{where}: '{url[:80]}' is outside --allowed_local_media {root}.",
                param=where,
                code="invalid_image",
            )
        return str(path)

    def _encode(self, conv: list, images: list, tools: Optional[list]):
        from onegpu.errors import OnegpuError
        from onegpu.infer.images import prompt_images

        text = render_chat(self.processor, conv, tools, tokenize=False, add_generation_prompt=True)
        if not images:
            return self.processor.tokenizer(text, add_special_tokens=False)["input_ids"], None
        try:
            return prompt_images(self.processor, text, images)
        except (OnegpuError, ValueError) as exc:  # more images than placeholders, ...
            raise APIError(
                400,
                f"the images do not fit the prompt: {exc}",
                param="messages",
                code="invalid_image",
            ) from None


def _for_template(message) -> dict:
    """The message as the processor's chat template reads it: text and image parts in order."""
    out = message.for_template()
    if isinstance(message.content, list):
        out["content"] = [
            {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
            for p in message.content
        ]
    return out
