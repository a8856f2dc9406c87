"""The server's Prometheus metrics (prometheus-client), in a registry of their own so that two
servers in one process (tests) do not share counters. Names follow vLLM's where one exists."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: a tiny model on CPU answers in milliseconds, a 70B one in tens of seconds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "onegpu_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "onegpu_prompt_tokens", "prompt tokens of finished sequences", registry=r
        )
        self.generated_tokens = Counter(
            "onegpu_generation_tokens", "tokens generated (sent or not)", registry=r
        )
        self.finished = Counter(
            "onegpu_sequences_finished",
            "sequences finished, by reason (stop, length, cancelled)",
            ["reason"],
            registry=r,
        )
        self.running = Gauge("onegpu_num_requests_running", "sequences in engine slots", registry=r)
        self.waiting = Gauge(
            "onegpu_num_requests_waiting", "sequences accepted, waiting for a slot", registry=r
        )
        self.kv_used = Gauge("onegpu_kv_positions_used", "KV-cache positions in use", registry=r)
        self.kv_total = Gauge("onegpu_kv_positions_total", "KV-cache positions in all", registry=r)
        self.kv_usage = Gauge("onegpu_kv_cache_usage_ratio", "KV-cache use, 0 to 1", registry=r)
        self.prefix_queries = Counter(
            "onegpu_prefix_cache_queries",
            "prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "onegpu_prefix_cache_hits", "prompt tokens found in the prefix cache", registry=r
        )
        self.preemptions = Counter(
            "onegpu_num_preemptions",
            "sequences preempted for lack of KV blocks (recomputed later)",
            registry=r,
        )
        self.compiles = Counter(
            "onegpu_decode_compiles",
            "decode-step shapes compiled after the warm-up (each one stalls every stream)",
            registry=r,
        )
        self.compile_seconds = Counter(
            "onegpu_decode_compile_seconds", "seconds those compiles took", registry=r
        )
        self.prompt_computed = Counter(
            "onegpu_prompt_tokens_computed",
            "prompt positions the engine's forwards computed (not found in the prefix cache)",
            registry=r,
        )
        self.decode_steps = Counter(
            "onegpu_decode_steps",
            "decode steps run (each a token for every decoding row)",
            registry=r,
        )
        self._seen = (0,) * 10  # the engine's running totals at the last look
        # speculative decoding, as vLLM's spec_decode counters
        self.spec_drafts = Counter(
            "onegpu_spec_decode_num_drafts", "speculative verifications run", registry=r
        )
        self.spec_draft_tokens = Counter(
            "onegpu_spec_decode_num_draft_tokens", "tokens proposed for verification", registry=r
        )
        self.spec_accepted = Counter(
            "onegpu_spec_decode_num_accepted_tokens", "proposed tokens accepted", registry=r
        )
        self.spec_per_position = Counter(
            "onegpu_spec_decode_num_accepted_tokens_per_pos",
            "proposed tokens accepted, by position in the proposal (0: the first)",
            ["position"],
            registry=r,
        )
        self._seen_positions: tuple[int, ...] = ()
        self.ttft = Histogram(
            "onegpu_time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "onegpu_e2e_request_latency_seconds",
            "arrival to last token of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def engine_stats(self, stats, waiting_outside: int = 0) -> None:
        """The engine's slots and cache after a step; ``waiting_outside``: accepted sequences the
        engine has not been handed yet."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting + waiting_outside)
        self.kv_used.set(stats.kv_positions_used)
        self.kv_total.set(stats.kv_positions_total)
        self.kv_usage.set(stats.kv_positions_used / max(1, stats.kv_positions_total))
        totals = (
            stats.prefix_queries,
            stats.prefix_hits,
            stats.preemptions,
            stats.compiles,
            stats.compile_s,
            stats.spec_drafts,
            stats.spec_proposed,
            stats.spec_accepted,
            stats.prefill_tokens,
            stats.decode_steps,
        )
        counters = (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.compiles,
            self.compile_seconds,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted,
            self.prompt_computed,
            self.decode_steps,
        )
        for counter, now, before in zip(
            counters,
            totals,
            self._seen,
            strict=True,
        ):
            counter.inc(now - before)
        self._seen = totals
        positions = stats.spec_accepted_per_position
        before = self._seen_positions or (0,) * len(positions)
        for i, (now, was) in enumerate(zip(positions, before, strict=True)):
            self.spec_per_position.labels(position=str(i)).inc(now - was)
        self._seen_positions = positions

    def render(self) -> bytes:
        return generate_latest(self.registry)
