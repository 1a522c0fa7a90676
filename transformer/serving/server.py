"""Running the app with uvicorn on a socket the caller bound, until SIGTERM or SIGINT (once the
requests in flight are answered), or until its decoding thread has stopped for good."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from contextlib import contextmanager

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except for what happens after a signal: uvicorn stops accepting, answers
    the requests in flight, runs the app's shutdown, and then raises the signal again, which kills
    the process with it. Here the signal only starts that shutdown, and run() returns. So does a
    `stopped()` that names an error (checked at uvicorn's ticks, every 0.1 s)."""

    def __init__(self, config: uvicorn.Config, stopped: Callable[[], str | None]):
        super().__init__(config)
        self.stopped = stopped

    async def on_tick(self, counter: int) -> bool:
        return await super().on_tick(counter) or self.stopped() is not None

    @contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(app, sock: socket.socket, access_log: bool = False, drain_seconds: float = 30) -> str | None:
    """Serve `app` on the bound socket until SIGTERM or SIGINT, then give the requests in flight up to
    drain_seconds (a client that stalls mid-request must not hold the shutdown forever); uvicorn
    logs through the root logger. Returns why the app's decoding thread stopped, if it did."""
    config = uvicorn.Config(app, log_config=None, access_log=access_log, timeout_graceful_shutdown=drain_seconds)
    service = app.state.service
    DrainingServer(config, lambda: service.stopped).run(sockets=[sock])
    return service.stopped
