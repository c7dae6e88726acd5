"""The HTTP server process around the app: the socket, and a shutdown that drains the scheduler.

uvicorn's own shutdown waits for open connections, then tells the app it is
shutting down; a scheduler told only then would serve waiting requests
during the wait and have its live streams cut when it ends. Here the
scheduler's drain starts with the shutdown: waiting requests are refused at
once with 503, live ones get the drain time to finish, and the rest end with
an ``error`` event and ``[DONE]`` while their connections are still open.
"""

from __future__ import annotations

import errno
import socket

import uvicorn

# The time after the drain for the last events (an error event, [DONE]) to reach the clients.
FLUSH_SECONDS = 10.0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, or ``SystemExit`` saying why not (before anything
    slow starts: a port in use is reported at once, not after the models load)."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"error: --port {port} is not a TCP port; give one in 0 .. 65535 (0: any free port).")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SystemExit(f"error: --host {host}: {e.strerror}; give an address such as 127.0.0.1 or 0.0.0.0.")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = ("another process listens there; stop it or give another --port"
                if e.errno == errno.EADDRINUSE else "give another --host or --port")
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror}; {hint}.") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose shutdown (SIGINT, SIGTERM, ``should_exit``) first starts the
    scheduler's drain (:meth:`specjax._src.serve.scheduler.Scheduler.begin_close`)."""

    def __init__(self, config: uvicorn.Config, scheduler, drain_seconds: float):
        super().__init__(config)
        self.scheduler, self.drain_seconds = scheduler, drain_seconds

    async def shutdown(self, sockets=None) -> None:
        self.scheduler.begin_close(self.drain_seconds)
        await super().shutdown(sockets=sockets)


def make_server(app, scheduler, *, drain_seconds: float, log_level: str = "info") -> DrainingServer:
    """The server for ``app``; its graceful timeout leaves the drain :data:`FLUSH_SECONDS` to
    deliver its last events. Run it with ``server.run(sockets=[bind(host, port)])``."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_seconds + FLUSH_SECONDS)
    return DrainingServer(config, scheduler, drain_seconds)
