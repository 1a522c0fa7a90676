"""Running the app with uvicorn on a socket the caller bound, ending with status 0 on SIGTERM or
SIGINT once the requests in flight are answered."""

from __future__ import annotations

import signal
import socket
from contextlib import contextmanager

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except for what happens after a signal: uvicorn stops accepting, answers
    the requests in flight, runs the app's shutdown, and then raises the signal again, which kills
    the process with it. Here the signal only starts that shutdown, and run() returns."""

    @contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(app, sock: socket.socket, access_log: bool = False, drain_seconds: float = 30) -> None:
    """Serve `app` on the bound socket until SIGTERM or SIGINT, then give the requests in flight up to
    drain_seconds (a client that stalls mid-request must not hold the shutdown forever); uvicorn
    logs through the root logger."""
    config = uvicorn.Config(app, log_config=None, access_log=access_log, timeout_graceful_shutdown=drain_seconds)
    DrainingServer(config).run(sockets=[sock])
