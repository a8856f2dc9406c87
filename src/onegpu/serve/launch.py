"""`onegpu serve` from its settings to a listening server: load the model and its adapters, size
the KV cache from the memory left after the weights, build the engine, and run until told to stop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

from onegpu.errors import ConfigError
from onegpu.serve.config import ServeConfig

log = logging.getLogger(__name__)


def make_engine(model, tokenizer, cfg: ServeConfig, grammars=None, adapters=()):
    """The server's engine: its pool sized from the memory left after the weights (capped at
    --kv_memory), the server's grammar compiler (the one that checks requests as they arrive)
    and the adapters it routes by name."""
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.policy import parse_off

    config = EngineConfig(
        max_slots=cfg.max_slots,
        max_len=cfg.max_len,
        kv_budget=True,
        kv_memory=cfg.kv_memory,
        prefix_caching=cfg.prefix_caching,
        token_budget=cfg.token_budget,
        compile=cfg.compile,
        sync_every=cfg.sync_every,
        flush_ms=cfg.flush_ms,
        policy_off=parse_off(cfg.policy_off),
        speculative=cfg.speculative,
        num_speculative_tokens=cfg.num_speculative_tokens,
        ngram_min=cfg.ngram_min,
        ngram_max=cfg.ngram_max,
    )
    return Engine(model, tokenizer, config, grammars=grammars, adapters=tuple(adapters))


def startup_lines(engine, cfg: ServeConfig) -> list[str]:
    """What the server says of its engine before it listens: how the KV pool was sized, each
    policy row of the device on or off (the engine's own rows: --policy_off's among them) with
    what it measured, and whether prefixes are cached."""
    from onegpu.infer.policy import summary

    rows = summary(engine.device.type, on=engine.stats().policy_rows)
    return [
        engine.pool_plan.describe(),
        *(f"policy {line}" for line in rows),
        f"prefix caching: {'on' if cfg.prefix_caching else 'off'}",
    ]


def warm_up(engine, cfg: ServeConfig) -> None:
    """Compile every decode shape the server can ask for before it listens (--warmup); the
    compiled steps are kept in --compile_cache (set in serve) for the next start."""
    buckets = engine.warm_shapes()
    if not buckets or cfg.warmup == "off":
        if cfg.warmup == "on":
            _say("warm-up: nothing to compile (the decode step runs eagerly: --compile on)")
        return
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default")
    _say(f"warm-up: compiling the decode step for {buckets} shapes (compile cache: {cache})")
    from torch._dynamo.utils import counters

    before = dict(counters["inductor"])
    start = time.perf_counter()
    done = engine.warmup()
    took = time.perf_counter() - start
    keys = ("fxgraph_cache_hit", "fxgraph_cache_miss")
    hits, misses = (counters["inductor"][k] - before.get(k, 0) for k in keys)
    found = f"; inductor's graphs: {hits} from the cache, {misses} built" if hits + misses else ""
    _say(f"warm-up: {done} steps compiled in {took:.1f} s{found}")


def serve(icfg, cfg: ServeConfig) -> int:
    from onegpu.infer import load
    from onegpu.serve.adapters import ServedModels, attach_adapters, parse_adapters
    from onegpu.serve.app import Service, build_app
    from onegpu.serve.media import Media
    from onegpu.serve.metrics import Metrics
    from onegpu.serve.scheduler import Scheduler
    from onegpu.serve.server import run_server

    cfg.check()
    if cfg.compile_cache and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # before anything of torch asks for it: inductor sets its default there once asked
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.expanduser(cfg.compile_cache)
    adapters = parse_adapters(cfg.adapter)  # before loading: a typo should not cost a model load
    models = ServedModels(cfg.served_name or icfg.model, tuple(adapters))
    allowed = _allowed(cfg.allowed_local_media)
    loaded = load(icfg)
    model = attach_adapters(loaded.model, adapters)
    grammars = grammar_compiler(loaded.tokenizer, model)
    engine = make_engine(model, loaded.tokenizer, cfg, grammars, models.adapters)
    for line in startup_lines(engine, cfg):
        _say(line)
    warm_up(engine, cfg)
    metrics = Metrics()
    scheduler = Scheduler(engine, cfg.queue_size, metrics)
    api_key = cfg.api_key or os.environ.get("ONEGPU_API_KEY") or None
    service = Service(
        scheduler, loaded.tokenizer, models, metrics, engine.max_len, api_key, engine.features
    )
    add_request_features(service, loaded.tokenizer, cfg, grammars)
    if loaded.processor is not None:
        service.media = Media(loaded.processor, allowed)
        _say(f"images: data URLs, local files {cfg.allowed_local_media or 'off'}")
    _say(f"serving {', '.join(models.names())} on http://{cfg.host}:{cfg.port}/v1")
    return run_server(build_app(service), scheduler, cfg.host, cfg.port, cfg.grace)


def _allowed(folder: Optional[str]) -> Optional[Path]:
    if folder is None:
        return None
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"--allowed_local_media {folder} is not a folder.",
            hint="name an existing folder of images, or drop the flag (data URLs only)",
        )
    return path


def grammar_compiler(tokenizer, model=None):
    """The server's one grammar compiler (None without llguidance): the engine masks with it and
    the requests are checked with it as they arrive, so the tokenizer is prepared once (seconds
    at a 128k vocabulary). ``model``: its output width is the masks' (a model may hold more rows
    than the tokenizer has tokens)."""
    from onegpu.errors import UnavailableError

    try:
        from onegpu.infer.constraints import Grammars

        vocab = model.get_output_embeddings().weight.shape[0] if model is not None else None
        return Grammars(tokenizer, vocab)
    except UnavailableError:
        return None


def add_request_features(service, tokenizer, cfg: ServeConfig, grammars=None) -> None:
    """Tool calls (the format read from the chat template or --tool_parser) and the grammar check
    of structured-output requests (``grammars``: the engine's compiler; None: one of its own,
    grammar_compiler; without llguidance structured output is off). What the engine applies of
    penalties, logprobs and grammars is its ``features`` (Service.features): a request for one it
    does not apply is refused by name."""
    from onegpu.serve.tools import parser_for

    service.tool_format = parser_for(tokenizer.chat_template, cfg.tool_parser)
    service.json_schema_strict = cfg.json_schema_strict
    _say(f"tool calls: {service.tool_format or 'off (the chat template shows no format)'}")
    grammars = grammars or grammar_compiler(tokenizer)
    if grammars is None:
        _say("structured output: off (pip install 'onegpu[structured]')")
        return
    service.check_constraint = grammars.check


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
