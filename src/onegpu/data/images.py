"""The images of chat records, for vision-language models: found in the messages' content parts
(``{"type": "image", "image": PATH}``, OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``
with a data URL or a path) or in an images column beside the messages, in the order of the image
parts; read relative to the data file; opened with PIL; optionally resized (data.image_size).

A record's conversation is rewritten so that every image part is ``{"type": "image"}`` (what chat
templates render as the model's placeholder) and its images listed beside it, as sources: an
absolute path, or the data URL as given. ``open_image`` reads a source back, the same way when the
record is tokenized and when its batch is built.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path

from onegpu.errors import DataError

IMAGE_TYPES = ("image", "image_url")


class BadImage(DataError):
    """An image that is missing or cannot be read (data.on_bad_record decides: stop or skip)."""


def origin_folder(origin: str | None) -> Path:
    """The folder of the data file a record came from ("data/train.jsonl:5" -> data/), where
    relative image paths are read; the working directory when the record has no file."""
    if not origin:
        return Path.cwd()
    file = (
        origin.rsplit(":", 1)[0] if ":" in origin else origin.split(" item ")[0].split(" row ")[0]
    )
    path = Path(file)
    return path.parent if path.suffix else Path.cwd()


def split_images(conv: list, column, where: str, folder: Path) -> tuple[list, list[str]]:
    """(the conversation with each image part as {"type": "image"}, the image sources in order).
    ``column``: the record's images column (a list of paths), or None."""
    from_column = list(column) if column is not None else None
    if from_column is not None and not isinstance(column, (list, tuple)):
        raise DataError(
            f"{where}: the images column must be a list of image paths, got "
            f"{type(column).__name__}.",
            hint='write e.g. "images": ["cat.png"]',
        )
    sources: list[str] = []
    out = []
    for m in conv:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_TYPES:
                parts.append(part)
                continue
            ref = _part_source(part, kind)
            if ref is None:
                if not from_column:
                    raise DataError(
                        f"{where}: image part {len(sources) + 1} names no image and the images "
                        "column has no image left for it (more image parts than images).",
                        hint='give the part its file ({"type": "image", "image": "cat.png"}) or '
                        "list one image per image part in the images column",
                    )
                ref = from_column.pop(0)
            sources.append(resolve(str(ref), folder))
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    if from_column:
        raise DataError(
            f"{where}: {len(from_column)} image(s) in the images column have no image part in "
            "the messages (more images than placeholders).",
            hint='add one {"type": "image"} part per image, where the image belongs in the turn',
        )
    return out, sources


def _part_source(part: dict, kind: str):
    if kind == "image":
        return part.get("image") or part.get("path") or part.get("url")
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def resolve(ref: str, folder: Path) -> str:
    """A data URL as it is; a path made absolute against the data file's folder."""
    if ref.startswith("data:"):
        return ref
    if ref.startswith(("http://", "https://")):
        raise DataError(
            f"image '{ref[:80]}' is a web address; onegpu reads images from files or data URLs "
            "only (no downloads during training).",
            hint="download the images next to the data file and name them by path",
        )
    path = Path(ref).expanduser()
    return str(path if path.is_absolute() else (folder / path).resolve())


def open_image(source: str, where: str, longest_side: int = 0):
    """The image as an RGB PIL image (resized so its longest side is at most ``longest_side``);
    BadImage naming the record and the file when it is missing or unreadable."""
    from PIL import Image, UnidentifiedImageError

    try:
        if source.startswith("data:"):
            head, _, payload = source.partition(",")
            if ";base64" not in head:
                raise ValueError("not a base64 data URL")
            img = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        else:
            img = Image.open(source)
        img.load()
    except FileNotFoundError:
        raise BadImage(
            f"{where}: image file '{source}' does not exist.",
            hint="image paths are read relative to the data file; fix the path, or set "
            "data.on_bad_record=skip to leave such records out",
        ) from None
    except (OSError, UnidentifiedImageError, ValueError, binascii.Error) as exc:
        what = "data URL" if source.startswith("data:") else f"file '{source}'"
        raise BadImage(
            f"{where}: image {what} cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:120] if str(exc) else 'unreadable'}).",
            hint="replace the image with a PNG/JPEG/WebP file, or set data.on_bad_record=skip",
        ) from None
    img = img.convert("RGB")
    if longest_side and max(img.size) > longest_side:
        scale = longest_side / max(img.size)
        size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        img = img.resize(size, Image.Resampling.BICUBIC)
    return img
