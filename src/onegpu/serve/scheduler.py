"""The one thread that drives the engine, and admission in front of it.

The engine is not thread-safe, so every call to it happens on the engine-loop thread: requests reach
it through a thread-safe inbox (submit, cancel), it calls ``engine.step()`` while there is work, and
hands each update back to the request's event loop with ``call_soon_threadsafe``. A new request thus
joins the running batch at the next step. Admission is counted in sequences (a request with ``n``
choices is ``n``): at most ``max_slots`` run and ``queue_size`` wait; past that a request is refused
with 503 and Retry-After at once, instead of queueing without bound.

A step that raises is an engine-wide fault (what one request causes comes back as that request's
``Update.error``): the engine's state can no longer be trusted, so the loop stops, every request in
flight or queued gets a 500, admission closes, ``/health`` answers 503 with the error, and the
server is told to stop (``on_failure``) and exits non-zero, for a supervisor to restart it, as
vLLM's server does when its engine dies."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from onegpu.errors import OnegpuError
from onegpu.serve.schemas import APIError

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long an idle loop blocks on the inbox before looking again
RETRY_AFTER_S = 1


class Ticket:
    """One HTTP request: its engine sequences (prompt ids, sampling params) and the news they
    produce, delivered on the request's event loop as (sequence index, Update or error);
    ``images``: its prompt's images (infer/images.py), the same for each of its sequences."""

    def __init__(
        self, sequences: list, adapter: Optional[str], loop: asyncio.AbstractEventLoop, images=None
    ):
        self.sequences = sequences
        self.adapter = adapter
        self.images = images
        self.loop = loop
        self.news: asyncio.Queue = asyncio.Queue()
        self.rids: list[int] = []  # engine-loop thread only
        self.cancelled = False  # engine-loop thread only

    async def next(self):
        index, item = await self.news.get()
        if isinstance(item, Exception):
            raise item
        return index, item

    def post(self, index: int, item) -> None:
        """From the engine-loop thread: hand one update (or error) to the request's loop."""
        try:
            self.loop.call_soon_threadsafe(self.news.put_nowait, (index, item))
        except RuntimeError:  # the request's loop is closed: the server is gone, nobody listens
            pass


@dataclass(frozen=True)
class Health:
    running: int
    waiting: int
    in_flight: int
    capacity: int
    kv_positions_used: int
    kv_positions_total: int
    accepting: bool
    error: Optional[str] = None  # the engine failed: the server is stopping


class Scheduler:
    def __init__(self, engine, queue_size: int, metrics):
        self.engine = engine
        self.metrics = metrics
        self.capacity = engine.max_slots + queue_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # set while a command waits: the engine ends its decode steps early when a row is free
        # for it, so a new request starts without waiting for the rest of them
        self._arrived = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0  # sequences accepted and not finished
        self._accepting = True
        self._owners: dict[int, tuple[Ticket, int]] = {}  # engine rid -> (ticket, index)
        self.failure: Optional[str] = None  # the engine-wide fault that stopped the loop
        self.on_failure: Optional[Callable[[], None]] = None  # called once it has stopped
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ------------------------------------------------------------------ the event-loop side
    def start(self) -> None:
        self._thread.start()

    def submit(self, ticket: Ticket) -> None:
        n = len(ticket.sequences)
        if n > self.capacity:
            raise APIError(
                400,
                f"this request asks for {n} sequences (prompts x n); the server holds at most "
                f"{self.capacity} (--max_slots + --queue_size).",
                param="n",
                code="too_many_sequences",
            )
        with self._lock:
            if self.failure is not None:
                raise self._failed()
            if not self._accepting:
                raise APIError(503, "the server is shutting down.", kind="server_error")
            if self._in_flight + n > self.capacity:
                raise APIError(
                    503,
                    f"the server is full ({self._in_flight} sequences running or waiting, "
                    f"{self.capacity} at most); retry in a moment.",
                    kind="server_error",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self._in_flight += n
            # under the lock: a fault stops the loop after it has failed what the inbox holds
            self._put(("submit", ticket))

    def cancel(self, ticket: Ticket) -> None:
        self._put(("cancel", ticket))

    def cut(self, message: str) -> None:
        """Fail every request still in flight with a 503 naming ``message`` (the drain's grace
        period ran out): each stream ends with its error event and [DONE], not a cut
        connection. Thread-safe."""
        error = APIError(503, message, kind="server_error", code="shutting_down")
        self._put(("cut", error))

    def close(self) -> None:
        """Stop taking requests; those accepted run to the end."""
        with self._lock:
            self._accepting = False

    def stop(self, timeout: float = 10.0) -> None:
        self.close()
        self._put(("stop", None))
        self._thread.join(timeout)

    def health(self) -> Health:
        s = self._stats
        with self._lock:
            in_flight, accepting = self._in_flight, self._accepting
        return Health(
            s.running,
            s.waiting,
            in_flight,
            self.capacity,
            s.kv_positions_used,
            s.kv_positions_total,
            accepting,
            self.failure,
        )

    # ------------------------------------------------------------------ the engine-loop thread
    def _run(self) -> None:
        while self._take_commands(block=not self.engine.has_work()):
            if self.engine.has_work():
                try:
                    updates = self.engine.step(arrived=self._arrived)
                except Exception as exc:  # noqa: BLE001 - answered, then the server stops
                    log.exception("engine step failed: the engine is stopped")
                    self._stop_failed(exc)
                    return
                self._deliver(updates)
            self._stats = self.engine.stats()
            self.metrics.engine_stats(self._stats)

    def _put(self, command: tuple) -> None:
        self._inbox.put(command)
        self._arrived.set()

    def _take_commands(self, block: bool) -> bool:
        """Run what the inbox holds; False once told to stop."""
        self._arrived.clear()  # before the drain: a command put from now on sets it again
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, item = command
            if kind == "stop":
                return False
            {"submit": self._admit, "cancel": self._cancel, "cut": self._fail_all}[kind](item)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:  # gone before it reached the engine
            self._release(len(ticket.sequences))
            return
        for index, (ids, params) in enumerate(ticket.sequences):
            try:
                rid = self.engine.submit(ids, params, adapter=ticket.adapter, images=ticket.images)
            except Exception as exc:  # noqa: BLE001 - a refused request must not stop the loop
                ticket.post(index, _refusal(exc))
                self._release(len(ticket.sequences) - index)
                self._cancel(ticket)
                return
            ticket.rids.append(rid)
            self._owners[rid] = (ticket, index)

    def _cancel(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        for rid in ticket.rids:
            if rid in self._owners:
                self.engine.cancel(rid)

    def _deliver(self, updates: list) -> None:
        for update in updates:
            owner = self._owners.get(update.request_id)
            if owner is None:
                continue
            ticket, index = owner
            if update.error is not None:  # this request alone failed in the engine
                self._fail_one(ticket, index, update)
                continue
            self.metrics.generated_tokens.inc(len(update.token_ids))
            if update.finished:
                del self._owners[update.request_id]
                self.metrics.prompt_tokens.inc(update.prompt_tokens)
                self.metrics.finished.labels(update.finish_reason).inc()
                self._release(1)
            ticket.post(index, update)

    def _fail_one(self, ticket: Ticket, index: int, update) -> None:
        """A request the engine failed alone (Update.error): its caller gets a 500, its other
        choices are cancelled, everyone else goes on."""
        del self._owners[update.request_id]
        self.metrics.finished.labels("error").inc()
        self._release(1)
        ticket.post(
            index, APIError(500, f"this request failed: {update.error}", kind="server_error")
        )
        self._cancel(ticket)

    def _failed(self) -> APIError:
        return APIError(
            500,
            f"the engine failed ({self.failure}); the server is stopping.",
            kind="server_error",
            code="engine_failed",
        )

    def _stop_failed(self, exc: Exception) -> None:
        """An engine-wide fault: close admission, fail every request in flight and every one
        still in the inbox, then tell the server (on_failure)."""
        with self._lock:
            self.failure = f"{type(exc).__name__}: {exc}"
            self._accepting = False
        error = self._failed()
        self._fail_all(error)
        while True:  # submitted before admission closed, not yet admitted
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                for index in range(len(item.sequences)):
                    item.post(index, error)
                self._release(len(item.sequences))
        if self.on_failure is not None:
            self.on_failure()

    def _fail_all(self, error: APIError) -> None:
        """Every running request gets ``error`` and is let go (its slot is freed by the cancel): a
        request that cannot finish must not hold its caller, or its place in the count."""
        for rid, (ticket, index) in list(self._owners.items()):
            ticket.post(index, error)
            del self._owners[rid]
            self._release(1)
            try:
                self.engine.cancel(rid)
            except Exception:  # noqa: BLE001 - the engine is already in trouble; the 500 is sent
                log.exception("cancel after a failed step failed")

    def _release(self, n: int) -> None:
        with self._lock:
            self._in_flight -= n


def _refusal(exc: Exception) -> APIError:
    """The engine's own refusal (a limit, an adapter) is the caller's 400; anything else is ours."""
    if isinstance(exc, OnegpuError):
        return APIError(400, exc.message, code="invalid_request")
    log.exception("engine.submit failed")
    return APIError(500, f"the engine could not take the request: {exc}", kind="server_error")
