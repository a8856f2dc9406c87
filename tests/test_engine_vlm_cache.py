"""The engine's prefix cache with images, and the mrope families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
through the engine's other paths: each block is keyed by the images whose placeholders it holds
(a system prompt before an image is shared across images, nothing at or after the first
placeholder is; a repeated image is a full hit), and a Qwen prompt's rotary offset holds for a
cached prefix past its image, a recompute after preemption, speculative verification and a
compiled decode step — each answer the one its request gets alone."""

from __future__ import annotations

import pytest

import test_engine_vlm
from onegpu.infer.images import cache_key, prompt_images
from onegpu.infer.kv_blocks import BlockPool, BlockTable, SpanKeys
from onegpu.infer.mrope import with_rope
from onegpu.infer.requests import SamplingParams
from test_engine_vlm import MROPE, chat, engine, hf_greedy, picture, run

loaded = test_engine_vlm.loaded  # the same fixture: this module builds its own models

pytestmark = pytest.mark.usefixtures("one_thread")
SYSTEM = "You read pictures and answer in one short sentence about what they show."


def system_chat(processor, question: str) -> str:
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
    ]
    return processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_a_block_is_keyed_by_the_images_it_holds_and_after_them_by_its_parent():
    """Two prompts of equal tokens whose second image differs: the blocks up to the one that holds
    the second image's placeholders are found, none from it on; a block wholly before the first
    image carries no image key (equal to a text prompt's)."""
    size, tokens = 4, list(range(40))
    first = SpanKeys("base", ((9, 13, "red"), (22, 27, "blue")))
    other = SpanKeys("base", ((9, 13, "red"), (22, 27, "green")))
    assert first.at(1, size) == "base"  # positions 4-7: before both images
    assert first.at(2, size) == first.at(3, size) == ("base", ("red",))  # 8-11, 12-15
    assert first.at(4, size) == "base"  # 16-19: between them, its parent carries red
    pool = BlockPool(32, size)
    table = BlockTable(pool.allocate(10))
    pool.register(table, tokens, first)
    assert len(pool.match(tokens, first, len(tokens))) == 10
    assert pool.match(tokens, other, len(tokens)) == table.blocks[:5]  # block 5 holds 22
    assert pool.match(tokens, "base", len(tokens)) == table.blocks[:2]  # a text prompt's
    assert pool.match(tokens, SpanKeys("base", ((9, 13, "grey"),)), 40) == table.blocks[:2]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_system_prompt_is_shared_across_images_and_nothing_at_or_after_the_image(family, loaded):
    model, proc = loaded(family)
    text = system_chat(proc, "what colour?")
    red = prompt_images(proc, text, [picture((200, 30, 30))])
    blue = prompt_images(proc, text, [picture((30, 30, 200))])
    assert red[0] == blue[0] and red[1].start >= 8  # two whole blocks before the image
    before = red[1].start // 4 * 4  # the tokens of the blocks wholly before the placeholders
    eng = engine(model, proc)
    first_red = run(eng, [red])[0][0]
    hits = eng.stats().prefix_hits
    got_blue = run(eng, [blue])[0][0]
    assert eng.stats().prefix_hits - hits == before  # exactly the system prompt's blocks
    assert got_blue == run(engine(model, proc), [blue])[0][0]  # as on an engine of its own
    assert got_blue == hf_greedy(model, proc, text, [picture((30, 30, 200))])[0]
    hits = eng.stats().prefix_hits
    again = run(eng, [red])[0][0]
    # the same text and image: every whole block but the last token's (its logits are computed)
    assert eng.stats().prefix_hits - hits == (len(red[0]) - 1) // 4 * 4
    assert again == first_red


def test_the_image_keys_need_each_images_own_span(loaded):
    """Two images in one prompt of LLaVA: each image's placeholders key their own blocks."""
    model, proc = loaded("llava")
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and then"},
                {"type": "image"},
                {"type": "text", "text": "which is red?"},
            ],
        }
    ]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids, im = prompt_images(proc, text, [picture((200, 30, 30)), picture((30, 30, 200))])
    _, other = prompt_images(proc, text, [picture((200, 30, 30)), picture((30, 200, 30))])
    assert len(im.spans) == 2 and im.spans[0] == other.spans[0] != other.spans[1]
    key = cache_key(None, im)
    start = im.spans[1][0] // 4
    assert key.at(start - 1, 4) != key.at(start, 4) == (None, (im.spans[1][2],))
    # and the engine's answer with both images is transformers'
    got = run(engine(model, proc), [(ids, im)])[0][0]
    assert got == hf_greedy(model, proc, text, [picture((200, 30, 30)), picture((30, 30, 200))])[0]


@pytest.mark.parametrize("family", MROPE)
def test_a_qwen_prefix_cached_past_the_image_keeps_the_rotary_offset(family, loaded):
    """The second prompt's piece starts after its image (no pixels fed again): its positions are
    its slots + the delta, as transformers' generate places them."""
    model, proc = loaded(family)
    img = [picture((30, 160, 30))]
    colour = prompt_images(proc, chat(proc, "what colour is it?"), img)
    question = chat(proc, "what colour is it, please?")
    shape = prompt_images(proc, question, img)
    assert with_rope(model, shape[1], shape[0]).rope_delta != 0
    eng = engine(model, proc)
    run(eng, [colour])
    hits = eng.stats().prefix_hits
    got = run(eng, [shape])[0][0]
    assert eng.stats().prefix_hits - hits >= shape[1].end  # past the image
    assert got == hf_greedy(model, proc, question, img)[0]


def answers(eng, requests, params) -> list[list[int]]:
    rids = [eng.submit(ids, params, images=im) for ids, im in requests]
    tokens = {r: [] for r in rids}
    while eng.has_work():
        for u in eng.step():
            assert u.error is None, u.error
            tokens[u.request_id] += u.token_ids
    return [tokens[r] for r in rids]


def test_qwen_image_requests_preempted_and_recomputed_answer_as_alone(loaded):
    """A recomputed sequence's piece runs over its prompt and its answer so far: the answer's
    tokens at slot + delta."""
    model, proc = loaded("qwen2_vl")
    colours = [(200, 30, 30), (30, 30, 200), (30, 160, 30), (90, 90, 90)]
    requests = [prompt_images(proc, chat(proc, "what colour?"), [picture(c)]) for c in colours]
    long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    # four rows, blocks for about two of them: the youngest are preempted and recomputed
    tight = engine(model, proc, num_blocks=26, max_len=64, prefix_caching=False)
    got = answers(tight, requests, long)
    assert tight.stats().preemptions > 0
    assert got == [answers(engine(model, proc, max_len=64), [r], long)[0] for r in requests]


def test_qwen_speculative_verification_keeps_the_rotary_offset(loaded):
    model, proc = loaded("qwen2_5_vl")
    img = [picture((200, 30, 30))]
    request = prompt_images(proc, chat(proc, "what colour? what colour? what colour?"), img)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    # a proposal is looked up at every step (sync_every 1), and never paused
    spec = engine(model, proc, speculative="ngram", ngram_min=1, spec_min_accepted=0, sync_every=1)
    got = answers(spec, [request], params)
    # verifications ran over the image's prompt, and some of their tokens were kept
    assert spec.stats().spec_proposed > 0 and spec.stats().spec_accepted > 0
    assert got == answers(engine(model, proc), [request], params)


def test_a_compiled_qwen_decode_step_answers_as_the_eager_one(loaded):
    model, proc = loaded("qwen3_vl")
    text = chat(proc, "what colour?")
    requests = [
        prompt_images(proc, text, [picture((200, 30, 30))]),
        (proc.tokenizer(chat(proc, "say hi", False), add_special_tokens=False)["input_ids"], None),
    ]
    compiled = engine(model, proc, compile="on", compile_backend="aot_eager")
    got = answers(compiled, requests, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert compiled.stats().compiles >= 1  # the decode steps ran compiled
    assert got == answers(engine(model, proc), requests, SamplingParams(8, ignore_eos=True))
