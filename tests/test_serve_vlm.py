"""`onegpu serve` with a vision-language model: OpenAI image_url parts as data URLs answer what
the engine answers for the same chat, local files only inside --allowed_local_media, and a bad
image (unreadable, a web address, a file outside the folder) is a 400 naming the part while the
server keeps serving. One live server for the module (127.0.0.1)."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

from serve_support import Server
from vlm_zoo import save_tiny_vlm

TOKENS = 8
QUESTION = "what colour?"


def png(colour) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (40, 30), colour)
    img.paste((255, 255, 255), (5, 5, 15, 15))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-vlm")
    model = save_tiny_vlm("llava", root / "llava")
    media, outside = root / "media", root / "outside"
    media.mkdir()
    outside.mkdir()
    (media / "red.png").write_bytes(png((200, 30, 30)))
    (outside / "blue.png").write_bytes(png((30, 30, 200)))
    return model, media, outside


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    model, media, _ = files
    args = ["--model", str(model), "--served_name", "m", "--max_len", "256", "--max_slots", "2"]
    args += ["--allowed_local_media", str(media)]
    srv = Server(args, tmp_path_factory.mktemp("serve-vlm-log") / "server.log")
    yield srv
    srv.stop()


def ask(server, url: str, question: str = QUESTION) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": TOKENS,
        "temperature": 0,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def engine_answer(model_dir, url: str) -> str:
    """The engine's greedy answer to the same chat, called directly (no server)."""
    from onegpu.infer import InferConfig, load
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.engine_generate import run_requests
    from onegpu.infer.images import chat_prompt
    from onegpu.infer.requests import SamplingParams

    loaded = load(InferConfig(model=str(model_dir)))
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    ids, images = chat_prompt(loaded.processor, [{"role": "user", "content": parts}], "request")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_slots=2, max_len=256))
    (result,) = run_requests(engine, [ids], [SamplingParams(max_new_tokens=TOKENS)], [images])
    return result.text


def test_a_data_url_image_answers_what_the_engine_answers(server, files):
    model, media, _ = files
    url = data_url((media / "red.png").read_bytes())
    reply = ask(server, url)
    assert reply.status_code == 200, reply.text
    answer = reply.json()["choices"][0]["message"]["content"]
    assert answer == engine_answer(model, url)
    # the same picture from the allowed folder, as a path and as a file:// URL
    for local in (str(media / "red.png"), (media / "red.png").as_uri()):
        again = ask(server, local)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"] == answer
    other = ask(server, data_url(png((30, 30, 200))))
    assert other.json()["usage"]["prompt_tokens"] == reply.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "url, why",
    [
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "cannot be read"),
        ("https://example.com/cat.png", "web address"),
        ("OUTSIDE", "outside --allowed_local_media"),
        ("MEDIA/../outside/blue.png", "outside --allowed_local_media"),
        ("MEDIA/missing.png", "does not exist"),
    ],
)
def test_a_bad_image_is_a_400_naming_the_part_and_the_server_goes_on(server, files, url, why):
    _, media, outside = files
    url = url.replace("OUTSIDE", str(outside / "blue.png")).replace("MEDIA", str(media))
    reply = ask(server, url)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert why in error["message"]
    assert error["param"] == "messages[0].content[0]"
    assert ask(server, data_url(png((10, 200, 10)))).status_code == 200


def test_a_text_model_refuses_an_image_part_by_name():
    from onegpu.serve.media import Media
    from onegpu.serve.schemas import APIError, ChatRequest

    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": content}]})
    with pytest.raises(APIError, match=r"messages\[0\]\.content\[1\] is an image") as err:
        Media().prompt(req, None)
    assert err.value.status == 400
