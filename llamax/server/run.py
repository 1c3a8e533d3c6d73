"""`llamax serve`: load the model, build the Engine and its app, and run it under uvicorn.

The listening socket is bound here, before uvicorn starts, so that `--port 0` works (the kernel
picks a free port and the URL reported once the server accepts requests names it): serve() hands
the URL to its `ready` callback, or logs "listening on http://HOST:PORT" on llamax.server; the CLI
prints `llamax serve: listening on http://HOST:PORT` on stderr. SIGINT / SIGTERM stop the server: the
Engine's requests are cancelled first, so open streams end at once instead of holding the
shutdown, then uvicorn closes the connections.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger("llamax.server")


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(addr)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(engine, *, host: str = "127.0.0.1", port: int = 8080, model_name: str = "llamax",
          api_key: str | None = None, max_body_bytes: int | None = None, max_tokens: int | None = None,
          max_connections: int = 2048, ready: Callable[[str], None] | None = None,
          cors_origins: Sequence[str] | None = None, pooling: str | None = None) -> int:
    """Serve engine over HTTP until SIGINT / SIGTERM; returns the exit status.

    ready: called with the server's URL once it accepts requests (default: an INFO record on the
    llamax.server logger). cors_origins: the browser origins allowed to call the server (None: any,
    as llama-server). pooling: /v1/embeddings' pooling (create_app).
    """
    import uvicorn

    from llamax.server.app import MAX_BODY_BYTES, create_app

    app = create_app(engine, model_name=model_name, api_key=api_key,
                     max_body_bytes=MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
                     max_tokens=max_tokens, cors_origins=cors_origins, pooling=pooling)
    sock = _bind(host, port)
    port = sock.getsockname()[1]

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                url = _url(host, port)
                if ready is None:
                    log.info("listening on %s", url)
                else:
                    ready(url)

        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT / SIGTERM end the server and the process exits 0 (uvicorn would re-raise the
            signal after its shutdown, ending the process by the signal)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        async def shutdown(self, sockets=None) -> None:
            log.info("stopping (cancelling %d running requests)", engine.metrics()["slots_busy"])
            engine.close(cancel=True)
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5, limit_concurrency=max_connections,
                            timeout_keep_alive=30, server_header=False)
    try:
        Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
