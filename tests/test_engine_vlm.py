"""The decode engine with images: each family it runs gives transformers' greedy tokens and
first-token logprobs for image requests batched with each other and with a text request, a prompt
whose placeholders span several pieces is computed in one, the prefix cache keys blocks by the
image (equal text and different images share nothing; a repeated image is found), and the
families it cannot run are refused by name."""

from __future__ import annotations

import pytest
import torch

from onegpu.errors import ConfigError
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.images import prompt_images, usable_prefix
from onegpu.infer.mrope import with_rope
from onegpu.infer.requests import SamplingParams
from vlm_zoo import save_tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")
MROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
ENGINE_FAMILIES = ("llava", "llava_next", "gemma3", "idefics3", *MROPE)
NEW = 8
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """family -> (model, processor), a tiny saved model loaded back, built on first use."""
    import transformers

    from onegpu import vlm

    root = tmp_path_factory.mktemp("engine-vlm")
    made: dict = {}

    def get(family: str):
        if family not in made:
            path = save_tiny_vlm(family, root / family)
            model = transformers.AutoModelForImageTextToText.from_pretrained(
                str(path), dtype=torch.float32
            )
            made[family] = (model.eval(), vlm.load_processor(str(path)))
        return made[family]

    return get


def picture(colour, size=(40, 30)):
    from PIL import Image

    img = Image.new("RGB", size, colour)
    img.paste((255, 255, 255), (5, 5, 15, 15))
    return img


def chat(processor, question: str, with_image: bool = True) -> str:
    parts = [{"type": "image"}] if with_image else []
    msgs = [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def hf_greedy(model, processor, text, images):
    """transformers' generate: its greedy tokens and the first token's log-softmax."""
    enc = processor(
        text=[text],
        images=[images] if images else None,
        add_special_tokens=False,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=NEW,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    first = torch.log_softmax(out.scores[0][0].float(), -1)
    return out.sequences[0, enc["input_ids"].shape[1] :].tolist(), first


def run(engine, requests):
    """requests: (ids, images) -> per request (tokens, first token's logprob record)."""
    rids = [engine.submit(ids, GREEDY, images=im) for ids, im in requests]
    tokens = {r: [] for r in rids}
    firsts: dict = {}
    while engine.has_work():
        for u in engine.step():
            assert u.error is None, u.error
            tokens[u.request_id] += u.token_ids
            if u.logprobs and u.request_id not in firsts:
                firsts[u.request_id] = u.logprobs[0]
    return [(tokens[r], firsts[r]) for r in rids]


def engine(model, processor, **kw):
    cfg = dict(max_slots=4, max_len=256, compile="off", block_size=4, chunk=4)
    return Engine(model, processor.tokenizer, EngineConfig(**{**cfg, **kw}))


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_greedy_tokens_and_logprobs_equal_transformers_for_each_family(family, loaded):
    model, proc = loaded(family)
    cases = [
        (chat(proc, "what colour?"), [picture((200, 30, 30))]),
        (chat(proc, "what colour?"), [picture((30, 30, 200), (30, 44))]),
        (chat(proc, "say hi", with_image=False), []),
    ]
    requests = []
    chunk = 3 if family in MROPE else 4  # Qwen's tiny images are 2 x 2 or 2 x 1 tokens
    for text, images in cases:
        if images:
            ids, im = prompt_images(proc, text, images)
            # a piece would end inside the placeholders; they are computed in one
            assert im.start < chunk < im.end, (im.start, im.end)
        else:
            ids, im = proc.tokenizer(text, add_special_tokens=False)["input_ids"], None
        requests.append((ids, im))
    if family in MROPE:  # the text after the first image sits off its KV slots
        assert with_rope(model, requests[0][1], requests[0][0]).rope_delta != 0
    # the three in one batch: two images of different sizes and a text prompt
    got = run(engine(model, proc, chunk=chunk), requests)
    for (text, images), (tokens, first) in zip(cases, got, strict=True):
        want, logprobs = hf_greedy(model, proc, text, images)
        assert tokens == want, family
        assert first.logprob == pytest.approx(logprobs[want[0]].item(), abs=1e-4), family
        for token, value in first.top:
            assert value == pytest.approx(logprobs[token].item(), abs=1e-4), family


def test_gemma3_image_tokens_attend_both_ways(loaded):
    """Without the overlay (a causal mask over the image's tokens) the first logits differ: the
    test above would catch an engine that dropped it."""
    from onegpu.infer.images import bidirectional

    model, proc = loaded("gemma3")
    ids, im = prompt_images(proc, chat(proc, "what colour?"), [picture((200, 30, 30))])
    n = len(ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    mask = bidirectional(causal, im, 0, n)
    image = slice(im.start, im.end)
    inside = [i for i in range(n) if im.blocks[i] >= 0]
    assert inside and mask[0, 0, inside[0], inside[-1]].item()  # the first sees the last
    assert not mask[0, 0, : im.start, image].any()  # the text before never sees the image
    with torch.no_grad():
        enc = {k: torch.as_tensor(v) for k, v in im.features.items()}
        x = torch.tensor([ids])
        both = model(input_ids=x, attention_mask=mask, **enc).logits[0, -1]
        one_way = model(input_ids=x, attention_mask=causal, **enc).logits[0, -1]
    assert not torch.allclose(both, one_way, atol=1e-4)


def test_prefix_cache_keys_blocks_by_the_image(loaded):
    model, proc = loaded("llava")
    text = chat(proc, "what colour?")
    red = prompt_images(proc, text, [picture((200, 30, 30))])
    blue = prompt_images(proc, text, [picture((30, 30, 200))])
    assert red[0] == blue[0] and red[1].digest != blue[1].digest  # same tokens, other pixels
    eng = engine(model, proc)
    first_red = run(eng, [red])[0][0]
    hits = eng.stats().prefix_hits
    got_blue = run(eng, [blue])[0][0]
    assert eng.stats().prefix_hits == hits  # nothing of the red image's blocks is reused
    assert got_blue == run(engine(model, proc), [blue])[0][0]  # as on an engine of its own
    assert got_blue != first_red
    again = run(eng, [red])[0][0]
    assert eng.stats().prefix_hits > hits  # the repeated image and its prompt are found
    assert again == first_red


def test_a_cached_prefix_past_the_image_is_reused_and_never_cut_inside_it(loaded):
    model, proc = loaded("llava")
    img = [picture((30, 160, 30))]
    colour = prompt_images(proc, chat(proc, "what colour is it?"), img)
    shape = prompt_images(proc, chat(proc, "what shape is it, please?"), img)
    eng = engine(model, proc)
    run(eng, [colour])
    hits = eng.stats().prefix_hits
    got = run(eng, [shape])[0][0]  # its piece starts after the image: no pixels fed again
    assert eng.stats().prefix_hits - hits >= shape[1].end - 4
    assert got == hf_greedy(model, proc, chat(proc, "what shape is it, please?"), img)[0]
    im = shape[1]
    assert usable_prefix(im, (im.end + 3) // 4, 4) == (im.end + 3) // 4  # past the image: all
    inside = (im.start + 4) // 4  # blocks ending inside the placeholders
    assert usable_prefix(im, inside, 4) == im.start // 4


def test_an_mrope_family_the_engine_was_not_checked_on_is_refused_by_name():
    import transformers

    cfg = transformers.Glm4vConfig(
        vision_config=dict(
            depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64
        ),
        text_config=dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=300,
        ),
    )
    model = transformers.AutoModelForImageTextToText.from_config(cfg)
    with pytest.raises(ConfigError, match="glm4v.*mrope"):
        Engine(model, None, EngineConfig(max_len=64, compile="off"))


def test_images_for_a_text_model_are_refused(loaded, tiny_tokenizer):
    from families import tiny_family_model

    model, proc = loaded("llava")
    ids, im = prompt_images(proc, chat(proc, "what colour?"), [picture((1, 2, 3))])
    text_model = tiny_family_model("llama", tiny_tokenizer).eval()
    eng = Engine(text_model, None, EngineConfig(max_len=128, compile="off"))
    with pytest.raises(ConfigError, match="text-only model"):
        eng.submit([1, 2, 3], GREEDY, images=im)


def test_generate_cli_with_images_answers_as_the_engine(loaded, tmp_path, capsys):
    """`onegpu generate --image` and a prompts file naming images beside it (read relative to
    the file) give the engine's greedy answers for those chats."""
    import json

    from onegpu.cli.main import main
    from onegpu.infer.engine_generate import run_requests
    from onegpu.infer.images import chat_prompt

    model, proc = loaded("llava")
    folder = tmp_path / "llava"
    model.save_pretrained(str(folder))
    proc.save_pretrained(str(folder))
    picture((200, 30, 30)).save(tmp_path / "red.png")
    picture((30, 30, 200)).save(tmp_path / "blue.png")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "what colour?", "images": ["blue.png"]}) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(folder), "--greedy", "true", "--max_new_tokens", str(NEW)]
    argv += ["--image", str(tmp_path / "red.png"), "--output", str(out), "--prompts_file"]
    assert main([*argv, str(prompts), "what colour?"]) == 0
    capsys.readouterr()
    got = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    want = []
    for name in ("red.png", "blue.png"):
        parts = [
            {"type": "image", "image": str(tmp_path / name)},
            {"type": "text", "text": "what colour?"},
        ]
        ids, im = chat_prompt(proc, [{"role": "user", "content": parts}], "test")
        (r,) = run_requests(engine(model, proc), [ids], [SamplingParams(max_new_tokens=NEW)], [im])
        want.append(r.text)
    assert got == want and want[0] != want[1]
