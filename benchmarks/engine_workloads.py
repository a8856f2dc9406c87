"""One run of one engine workload, in a process of its own: `engine_ab.py` starts it with the
source tree of the engine to measure on PYTHONPATH (this checkout's, or another commit's checkout
for the engine it replaces) and reads one JSON line from its stdout.

    python benchmarks/engine_workloads.py WORKLOAD --engine '{"max_slots": 8, ...}' [--seed N]

Workloads (the model is built here at random, seeded, so every process has the same weights):

- decode: `onegpu bench infer --preset cpu`'s shape — the tiny preset (vocabulary 32,000), fp32,
  --batch rows of 512-token prompts, 128 new tokens — ms per decode step after every first token
  arrived (as bench infer's time_engine);
- capacity: --requests requests with prompts of 16-1,024 tokens and 16-256 new tokens (seeded),
  max_len 2,048, submitted at once: tokens/s, the peak of sequences running at once, each answer,
  the share of the decode rows computed that held a decoding sequence (the paged engine's)
  (--prompts_only: the same prompts with one new token each, what computing them costs);
- chat: --conversations chats of 4 turns, each turn resending the history (a 512-token system
  prompt and a 64-token message, 128-token answers, 64-token messages after): each turn's time to
  first token and the prompt tokens computed;
- shared: --requests requests of one 512-token system prompt and a 32-token message each, at once:
  times to first token and the prompt tokens computed;
- stall: 4 streams (64-token prompts) decoding, then a prompt 16 times longer arrives (or none,
  --no_long): the gaps between a running stream's updates (what a streaming client waits for its
  next text, vLLM's inter-token latency), and the streams' tokens/s from the long prompt's arrival
  to its first token (their pace while it is computed; without it, over the same number of
  steps from the same point).

Prompt tokens computed are counted at the model: the tokens of every forward of more than one
token a row (a prompt's or a piece's), for any engine.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import sys
import time

import torch

PRESETS = ("tiny", "125m")  # onegpu.models.PRESETS' shapes, as onegpu train builds them


def make_model(preset: str, context: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from onegpu.models import PRESETS as SHAPES  # the engine's own tree: both engines have them

    config = LlamaConfig(
        **dict(SHAPES[preset], max_position_embeddings=context),
        vocab_size=32000,
        tie_word_embeddings=preset in ("tiny", "small"),
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 2
    return model


class Counter:
    """Prompt tokens computed: every forward's tokens when it computes more than one a row."""

    def __init__(self, model):
        self.tokens = 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            self.tokens += ids.numel()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 32000) for _ in range(n)]


def engine(model, config: dict):
    from onegpu.infer.engine import Engine, EngineConfig

    return Engine(model, None, EngineConfig(**config))


def params(new: int):
    from onegpu.infer.requests import SamplingParams

    return SamplingParams(max_new_tokens=new, ignore_eos=True)


def drive(eng, submitted: dict, on_update=None) -> dict:
    """Step until done: each request's tokens, first-token time and update times."""
    out = {rid: {"tokens": [], "first": None, "times": [], "counts": []} for rid in submitted}
    while eng.has_work():
        updates = eng.step()
        now = time.perf_counter()
        for u in updates:
            rec = out[u.request_id]
            if u.token_ids:
                rec["tokens"] += u.token_ids
                rec["times"].append(now)
                rec["counts"].append(len(u.token_ids))
                if rec["first"] is None:
                    rec["first"] = now
        if on_update is not None:
            on_update(eng)
    return out


def digest(token_lists) -> str:
    return hashlib.sha256(json.dumps(token_lists).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------- workloads
def decode(args, config: dict) -> dict:
    if args.naive:
        return naive(args)
    model = make_model(args.preset, 1024)
    eng = engine(model, {"max_slots": args.batch, "max_len": 640, **config})
    rng = random.Random(args.seed)
    prompts = [tokens(rng, 512) for _ in range(args.batch)]
    for _ in range(2):  # warm-up (compiles), then the timed run
        got = drive(eng, {eng.submit(p, params(128)): i for i, p in enumerate(prompts)})
    everyone = max(r["first"] for r in got.values())  # the step every first token was out by
    done = max(r["times"][-1] for r in got.values())
    # the rows go in step: the steps timed are those after the tokens out by then
    out_by = min(
        sum(n for t, n in zip(r["times"], r["counts"], strict=True) if t <= everyone)
        for r in got.values()
    )
    steps = 128 - out_by
    return {
        "ms_per_step": 1000 * (done - everyone) / steps,
        "steps": steps,
        "answers": digest([r["tokens"] for r in got.values()]),
    }


def naive(args) -> dict:
    """The decode workload as a plain transformers loop: a StaticCache, the model's forward and
    the argmax compiled as one function, a token a row a call (no engine)."""
    from transformers import StaticCache

    from onegpu.infer.paged_cache import cache_kwarg

    model = make_model(args.preset, 1024)
    rng = random.Random(args.seed)
    ids = torch.tensor([tokens(rng, 512) for _ in range(args.batch)])
    cache = StaticCache(config=model.config, max_cache_len=640)
    kw = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}

    @torch.compile(dynamic=False)
    def step(tok, at):
        return model(input_ids=tok, cache_position=at, **kw).logits[:, -1].argmax(-1)[:, None]

    for _ in range(2):  # warm-up (compiles), then the timed run
        cache.reset()
        tok = model(input_ids=ids, cache_position=torch.arange(512), **kw).logits[:, -1:].argmax(-1)
        out = [tok]
        for i in range(127):
            if i == 1:  # timed from the second step on, as the engine's after every first token
                start = time.perf_counter()
            out.append(tok := step(tok, torch.tensor([512 + i])))
        ms = 1000 * (time.perf_counter() - start) / 126
    answers = torch.cat(out, 1).tolist()
    return {"ms_per_step": ms, "steps": 126, "answers": digest(answers)}


def capacity(args, config: dict) -> dict:
    model = make_model(args.preset, 2048)
    eng = engine(model, {"max_len": 2048, **config})
    rng = random.Random(args.seed)
    jobs = [
        (tokens(rng, rng.randint(16, 1024)), rng.randint(16, 256)) for _ in range(args.requests)
    ]
    if args.prompts_only:  # the same prompts, one token each: what computing them costs
        jobs = [(p, 1) for p, _ in jobs]
    peak = [0, 0, 0]  # sequences running at once; at that step, their tokens and blocks' positions

    def watch(e):
        stats = e.stats()
        if stats.running > peak[0]:
            running = getattr(getattr(e, "scheduler", None), "running", None)  # the paged engine's
            held = sum(len(s.tokens) for s in running) if running is not None else 0
            peak[:] = [stats.running, held, stats.kv_positions_used]

    before = eng.stats()
    start = time.perf_counter()
    ids = {eng.submit(p, params(n)): i for i, (p, n) in enumerate(jobs)}
    got = drive(eng, ids, watch)
    wall = time.perf_counter() - start
    # the decode row-steps computed, and of them those holding a decoding sequence: the engine's
    # own totals (an engine of an earlier commit that does not count them reports none)
    now, counts = eng.stats(), ("decode_rows", "decode_live_rows")
    rows = [getattr(now, c, 0) - getattr(before, c, 0) for c in counts]
    answers = [got[rid]["tokens"] for rid in sorted(ids, key=ids.get)]
    out = {
        "tokens_per_s": sum(map(len, answers)) / wall,
        "wall_s": wall,
        "peak_running": peak[0],
        "peak_tokens": peak[1],
        "peak_positions_used": peak[2],
        "live_rows": rows[1] / rows[0] if rows[0] else 0.0,
        "answers": digest(answers),
    }
    if args.alone:  # each request alone, through an engine of its own
        single = {"max_len": 2048, "max_slots": 1}
        alone = [engine(model, single).generate([p], params(n))[0] for p, n in jobs]
        out["alone_equal"] = [a.token_ids for a in alone] == answers
    return out


def chat(args, config: dict) -> dict:
    model = make_model(args.preset, 2048)
    count = Counter(model)
    eng = engine(model, {"max_len": 2048, **config})
    rng = random.Random(args.seed)
    eng.generate([tokens(rng, 40)], params(4))  # warm-up, another prompt
    count.tokens = 0
    ttft, answers = [], []
    for _ in range(args.conversations):
        history = tokens(rng, 512 + 64)
        for turn in range(4):
            start = time.perf_counter()
            rid = eng.submit(history, params(128))
            got = drive(eng, {rid: 0})[rid]
            ttft.append((turn, got["first"] - start))
            answers.append(got["tokens"])
            history = history + got["tokens"] + tokens(rng, 64)
    return {"ttft_s": ttft, "prompt_tokens_computed": count.tokens, "answers": digest(answers)}


def shared(args, config: dict) -> dict:
    model = make_model(args.preset, 2048)
    count = Counter(model)
    eng = engine(model, {"max_len": 1024, **config})
    rng = random.Random(args.seed)
    system = tokens(rng, 512)
    prompts = [system + tokens(rng, 32) for _ in range(args.requests)]
    eng.generate([tokens(rng, 40)], params(4))  # warm-up, another prompt
    count.tokens = 0
    start = time.perf_counter()
    ids = {eng.submit(p, params(32)): i for i, p in enumerate(prompts)}
    got = drive(eng, ids)
    order = sorted(ids, key=ids.get)
    return {
        "ttft_s": [got[r]["first"] - start for r in order],
        "prompt_tokens_computed": count.tokens,
        "answers": digest([got[r]["tokens"] for r in order]),
    }


def stall(args, config: dict) -> dict:
    model = make_model(args.preset, 2048)
    eng = engine(model, {"max_len": 2048, **config})
    rng = random.Random(args.seed)
    eng.generate([tokens(rng, 64)], params(8))  # warm-up
    streams = {eng.submit(tokens(rng, 64), params(256)): i for i in range(4)}
    log = {rid: [] for rid in streams}
    made = []  # (time, tokens the streams got in an update)
    long_at = long_id = long_first = None
    while eng.has_work():
        updates = eng.step()
        now = time.perf_counter()
        for u in updates:
            if u.request_id in log and u.token_ids:
                log[u.request_id].append(now)
                made.append((now, len(u.token_ids)))
            if u.request_id == long_id and u.token_ids and long_first is None:
                long_first = now
        decoding = min(len(v) for v in log.values()) >= 4
        if long_at is None and decoding:  # the streams are decoding now
            long_at = now
            long_id = None if args.no_long else eng.submit(tokens(rng, 1024), params(16))
    gaps = [b - a for times in log.values() for a, b in itertools.pairwise(times)]
    # without the long prompt: the streams' pace over the first 0.5 s from the same point
    end = long_first if long_first is not None else long_at + 0.5
    got = sum(n for t, n in made if long_at < t <= end)
    last = max((t for t, _ in made if long_at < t <= end), default=end)
    return {
        "gaps_s": gaps,
        "stream_tokens_per_s": got / max(last - long_at, 1e-9),
        "long_ttft_s": None if long_first is None else long_first - long_at,
    }


WORKLOADS = {
    "decode": decode,
    "capacity": capacity,
    "chat": chat,
    "shared": shared,
    "stall": stall,
    "budget": stall,  # the stall workload at several token budgets (engine_ab.py)
    "rows": decode,  # the decode workload at several row counts (engine_ab.py)
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("--engine", default="{}", help="EngineConfig fields, JSON")
    ap.add_argument("--preset", default="tiny", choices=PRESETS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--alone", action="store_true")
    ap.add_argument("--prompts_only", action="store_true", help="capacity: one new token each")
    ap.add_argument("--no_long", action="store_true")
    ap.add_argument("--naive", action="store_true", help="decode: the plain transformers loop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        result = WORKLOADS[args.workload](args, json.loads(args.engine))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
