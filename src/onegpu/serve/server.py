"""Running the app under uvicorn with a drain: SIGTERM stops new connections and new requests,
lets the accepted ones finish within ``grace`` seconds, stops the engine loop, and exits 0. What is
still running when the grace period ends is failed with a 503 (a stream gets its error event and
[DONE]); uvicorn waits ``CUT_MARGIN_S`` more for those last events before it cancels anything. An
engine that failed stops the server the same way, its requests already answered, and it exits 1."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

import uvicorn

log = logging.getLogger(__name__)
CUT_MARGIN_S = 2.0  # after the grace period: time to send the cut requests their last events


class DrainingServer(uvicorn.Server):
    """uvicorn's server that also closes admission when told to exit: a request arriving on a
    kept-alive connection during the drain gets a 503, not a place in a queue nobody will serve."""

    def __init__(self, config: uvicorn.Config, scheduler, grace: float):
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace
        self._cut: Optional[threading.Timer] = None

    def handle_exit(self, sig, frame) -> None:
        self.scheduler.close()
        if self._cut is None:
            message = (
                f"the server is shutting down and its grace period ({self.grace:g} s) ran out."
            )
            self._cut = threading.Timer(self.grace, self.scheduler.cut, (message,))
            self._cut.daemon = True
            self._cut.start()
        super().handle_exit(sig, frame)

    def stop_failed(self) -> None:
        """From the engine-loop thread, once every request has its error: stop (uvicorn's main
        loop reads the flag), giving the streams ``CUT_MARGIN_S`` to send their last events."""
        self.config.timeout_graceful_shutdown = CUT_MARGIN_S
        self.should_exit = True


def run_server(app, scheduler, host: str, port: int, grace: float) -> int:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        timeout_graceful_shutdown=grace + CUT_MARGIN_S,
        log_level="info",
        access_log=False,
    )
    server = DrainingServer(config, scheduler, grace)
    # The engine failed (serve/scheduler.py): every request has its 500; stop serving, exit 1.
    scheduler.on_failure = server.stop_failed
    # uvicorn raises the signal again once it has shut down; with the default SIGTERM handler that
    # would end the process by the signal after a clean drain. A drained stop is a success: exit 0.
    previous = signal.signal(signal.SIGTERM, _drained)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if scheduler.failure is not None:
        log.error("the engine failed (%s): exiting 1", scheduler.failure)
        return 1
    return 0


def _drained(_sig, _frame) -> None:
    log.info("drained; exiting")
