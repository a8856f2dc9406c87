"""A CPU engine's prefills on a second thread, while its own thread goes on decoding.

On a CPU the engine's steps run eagerly on one core (a decode step's small ops split over more
threads run slower), and a prefill — a prompt's whole forward — stops every running request for as
long as it takes. A prefill's large matmuls and attention release the GIL, so a second thread can
run them on a core the decode steps leave idle; the decode steps run somewhat slower while one runs
beside them (their Python waits for the GIL while the prefill's runs), and the running requests no
longer wait for it. Under the serve load test, both settings interleaved: 705 against 790 tokens/s
with 16 clients, p99 latency 2879 against 2328 ms (benchmarks/results/
serve-ab-cpu-prefill-thread.md).

What the prefill thread touches is its own: a cache object over the same tensors with a mode of
its own (``SlotCache.sharing``), the slot reserved for the request — into which no decode step
writes meanwhile: its row's position is parked at the last one, which no prompt fills and each
sequence writes before it reads — and the prompt's last logits, which it hands back. Everything
else (sampling the first token, the slot's state, the KV copied for a repeated prompt) stays on the
engine's thread, between its steps. One prefill at a time on the thread, in the order admitted;
in a burst of arrivals (more prefills waiting to start than sequences running) the engine's thread
prefills one per step too.

Only where it is safe and pays: a CPU, eager steps, a spare core for the thread's torch threads,
no per-row adapters (PEFT routes them with hooks on the shared modules, which a concurrent forward
would pick up), and no RoPE that rewrites its frequencies while it runs (dynamic, longrope).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Optional

import torch

from onegpu.errors import ConfigError
from onegpu.infer.decode_step import first_tokens, prefill
from onegpu.infer.slot_cache import base_model

Mode = Literal["auto", "on", "off"]


class PrefillThread:
    """The engine's prefills, one at a time on a thread of their own; results in admission order."""

    def __init__(self, engine, threads: int):
        self.engine = engine
        self.threads = threads
        self.cache = engine.cache.sharing()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="onegpu-prefill")
        self.jobs: deque[tuple[object, Future, Optional[object]]] = deque()

    def start(self, seq, source=None) -> None:
        """Prefill ``seq`` (in its reserved slot), or, with ``source``, take that sequence's
        prefill when it is done (the same prompt: its KV is copied then)."""
        self.engine.state.positions[seq.slot] = self.engine.max_len - 1  # park the row
        if source is None:
            future = self.pool.submit(self._run, seq)
        else:
            future = next(f for s, f, _ in self.jobs if s is source)
        self.jobs.append((seq, future, source))

    def _run(self, seq) -> torch.Tensor:
        torch.set_num_threads(self.threads)  # OpenMP's thread count is each thread's own
        with torch.no_grad():
            return prefill(self.engine, seq, self.cache, routed=False)

    def pending(self) -> bool:
        return bool(self.jobs)

    def ready(self) -> bool:
        """The oldest prefill is done: a sequence can join the decode steps."""
        return bool(self.jobs) and self.jobs[0][1].done()

    def join(self, admitted: set, wait: bool) -> list:
        """Sequences whose prefill is done (with ``wait``, every one, once done) join the running
        ones: the KV of a repeated prompt copied, the first token sampled, the slot's state set —
        here, on the engine's thread. Adds the ids that joined to ``admitted``; returns those
        cancelled meanwhile, for the engine to drop. A prefill's exception is raised here."""
        gone = []
        while self.jobs and (wait or self.jobs[0][1].done()):
            seq, future, source = self.jobs.popleft()
            seq.prefilling = False
            try:
                logits = future.result()
            except BaseException:
                seq.cancelled = True  # the engine's next step frees its slot
                raise
            if seq.cancelled:
                gone.append(seq)
                continue
            if source is not None:
                self.engine.cache.copy_slot(source.slot, seq.slot, len(seq.prompt))
            self._joins(seq, admitted, logits)
        return gone

    def _joins(self, seq, admitted: set, logits: Optional[torch.Tensor] = None) -> None:
        """``seq`` starts decoding: its first token and slot state (with no ``logits``, its
        prefill first, here and into the engine's own cache)."""
        seq.prefilling = False
        first_tokens(self.engine, seq, None, logits)
        seq.logits = None
        admitted.add(seq.id)

    def help(self, admitted: set, running: int) -> None:
        """More prefills wait to start than sequences run (a burst of arrivals: the prefills are
        what holds the batch back): the engine's thread prefills the oldest one not started
        itself, beside the thread's, and adds its id to ``admitted``. One per engine step, so the
        running ones keep decoding; with the batch full, never. A prompt that another sequence
        shares is left to the thread."""
        waiting = [job for job in self.jobs if not (job[1].running() or job[1].done())]
        if len(waiting) <= running:
            return
        sources = {id(source) for _, _, source in self.jobs if source is not None}
        for job in waiting:
            seq, future, source = job
            if source is not None or id(seq) in sources or not future.cancel():
                continue
            self.jobs.remove(job)
            self._joins(seq, admitted)
            return


def prefill_thread(mode: Mode, engine) -> Optional[PrefillThread]:
    """The engine's prefill thread, or None (prefills inline). auto: on where it is safe and a
    core is spare for it; on: wherever it is safe (a ConfigError names why not)."""
    if mode == "off":
        return None
    why = _unsafe(engine)
    threads = torch.get_num_threads()
    if why is None and mode == "auto" and 2 * threads > _cores():
        why = f"no spare core: the engine's {threads} torch threads on {_cores()} cores"
    if why is None:
        return PrefillThread(engine, threads)
    if mode == "on":
        raise ConfigError(f"engine prefill_thread 'on': {why}.", hint="prefill_thread 'auto'")
    return None


def _unsafe(engine) -> Optional[str]:
    """Why a prefill may not run beside the decode steps (None: it may)."""
    if engine.device.type != "cpu":
        return "a prefill thread is for a CPU engine (on a GPU both share one device)"
    if engine.stepper.compiled is not None:
        return "the decode steps are compiled (one compiled program at a time)"
    for module in base_model(engine.model).modules():
        rope = getattr(module, "rope_type", None)
        if isinstance(rope, str) and ("dynamic" in rope or rope == "longrope"):
            return f"the model's RoPE ({rope}) rewrites its frequencies during a forward"
    return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
