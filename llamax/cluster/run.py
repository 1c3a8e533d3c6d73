"""`llamax serve --replicas N`: start Ray (or join a cluster), run the application, stop cleanly.

Without a Ray address a local Ray instance is started with its node on loopback (127.0.0.1) and the
dashboard off, and it is stopped on exit. With --ray-address (auto, or HOST:PORT of a head node
started by `ray start --head`) the application is deployed on that cluster, replicas wherever Ray
places them, and only the application is deleted on exit: the cluster stays.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("llamax.cluster")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_replicas(model: str, *, replicas: int, threads: int, ray_address: str | None = None,
                   routing: str = "prefix", load_bound: int | None = None, host: str = "127.0.0.1",
                   port: int = 8080, engine_kw: dict[str, Any] | None = None,
                   server_kw: dict[str, Any] | None = None, ready: Callable[[str], None] | None = None) -> int:
    """Serve model from `replicas` Engine replicas (threads CPUs each) behind one endpoint until
    SIGINT / SIGTERM; returns the exit status.

    Args:
        routing: "prefix" (the longest cached prefix, within load_bound) or "round_robin".
        load_bound: in-flight requests a replica may have over the least loaded one and still get a
            request for its prefix (default: a replica's slots).
        engine_kw: llamax.Engine's keyword arguments; server_kw: llamax.server.create_app's.
        ready: called with the URL once the endpoint answers (default: an INFO record).
    """
    import ray
    from ray import serve

    from llamax.cluster.front import APP, build_app

    engine_kw = dict(engine_kw or {})
    if load_bound is None:
        load_bound = int(engine_kw.get("n_parallel", 4))
    if port == 0:
        port = _free_port(host)
    local = ray_address is None
    stop = threading.Event()
    if local:
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                 _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=True)
    else:
        ray.init(address=ray_address, configure_logging=False, log_to_driver=True)
    # after ray.init, whose core worker installs handlers of its own
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
            app = build_app(model, replicas=replicas, threads=threads,
                            routing_kw={"routing": routing, "load_bound": load_bound},
                            engine_kw=engine_kw, server_kw=dict(server_kw or {}))
            serve.run(app, name=APP, route_prefix="/")
            url = _url(host, port)
            if ready is None:
                log.info("listening on %s", url)
            else:
                ready(url)
            while not stop.wait(0.5):
                pass
            log.info("stopping")
        finally:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP)
            ray.shutdown()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0
