"""What an engine reports of itself (``Engine.stats``, serve's /metrics and start-up line): the
totals its loop keeps (``Totals``) and the snapshot of them and of its parts' own counts, the
pool's, the scheduler's, the runner's, the decode step's, the speculator's (``snapshot``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from onegpu.infer.requests import DecodeShape, EngineStats


@dataclass
class Totals:
    """The engine loop's own counts, in all since it was made."""

    decode_steps: int = 0
    decode_rows: int = 0  # rows those steps computed (empty rows of a bucket included)
    decode_live_rows: int = 0  # of them, rows holding a sequence decoding in the run
    batched_lora_steps: int = 0
    grammar_s: float = 0.0
    shapes: dict[tuple[int, int], DecodeShape] = field(default_factory=dict)

    def decoded(self, rows: int, kv_len: int, steps: int, reach: int, live: int, by_index: bool):
        """A decode run of ``steps`` steps over (rows, kv_len); ``reach``: the furthest position
        they could write; ``live``: its rows holding a decoding sequence; ``by_index``: its rows
        took their adapters by index (batched LoRA)."""
        self.decode_steps += steps
        self.decode_rows += rows * steps
        self.decode_live_rows += live * steps
        self.batched_lora_steps += steps if by_index else 0
        was = self.shapes.get((rows, kv_len), DecodeShape(rows, kv_len, 0, 0))
        reach = max(was.reach, reach)
        self.shapes[(rows, kv_len)] = DecodeShape(rows, kv_len, was.steps + steps, reach)


def snapshot(engine) -> EngineStats:
    """``engine``'s load and totals now, and how it decodes."""
    pool, s, step, runner = engine.pool, engine.scheduler, engine.decode_step, engine.runner
    drafts, proposed, accepted, by_position = engine.spec.counts.totals()
    t = engine.totals
    return EngineStats(
        running=len(s.running),
        waiting=len(s.waiting),
        kv_positions_used=(pool.usable - pool.free_count()) * pool.block_size,
        kv_positions_total=pool.usable * pool.block_size,
        prefix_queries=pool.stats.queries,
        prefix_hits=pool.stats.hits,
        preemptions=s.preemptions,
        compiles=step.compiles["serving"],
        compile_s=step.compile_s["serving"],
        kv_bytes=engine.cache.bytes,
        decode_steps=t.decode_steps,
        decode_rows=t.decode_rows,
        decode_live_rows=t.decode_live_rows,
        grammar_s=t.grammar_s,
        spec_drafts=drafts,
        spec_proposed=proposed,
        spec_accepted=accepted,
        spec_accepted_per_position=by_position,
        prefill_forwards=runner.prefills,
        prefill_tokens=runner.prefill_tokens,
        kv_gathers=engine.cache.gathered + runner.window.gathered,
        batched_lora_steps=t.batched_lora_steps,
        decode_shapes=tuple(t.shapes.values()),
        compiled_shapes=frozenset(step.warm),
        policy_rows=engine.policy.on(),
        matmul_rewrites=step.graph_pass.rewritten if step.graph_pass is not None else 0,
        decode_attention=step.attention,
    )
