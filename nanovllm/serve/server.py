"""Running the app: uvicorn, graceful shutdown, and a server on a background thread
(chapter 10).

``serve(config)`` builds the engine and serves until SIGTERM or Ctrl-C. Shutdown drains:
the first signal stops admitting -- the server keeps listening, new requests get 503 with
``Retry-After`` and ``/health`` answers 503 "draining", so a load balancer moves traffic
away -- and lets the requests in flight finish for up to ``grace_period`` seconds; whatever
still runs then is aborted, so its stream ends with finish_reason "abort" and its client
gets a complete response. Then uvicorn closes the socket and the process exits with status
0: a shutdown it was asked for. A second signal quits at once. If the engine stops unasked
(its core process killed, a failed step), every open request has ended with an error, and
the server stops and exits with status 1, so that a supervisor restarts it.

By default the engine core runs in a process of its own (``engine_process``, chapter 10 §8),
so that HTTP, JSON and detokenizing never hold up a step.

``ServerThread(app)`` runs an app on 127.0.0.1 on a free port in a background thread: for
tests, notebooks and the load generator (signals stay with the main thread).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.serve.app import build_app
from nanovllm.serve.config import ServeConfig
from nanovllm.serve.connections import with_header_deadline

logger = logging.getLogger("nanovllm.serve")
SHUTDOWN_MARGIN = 5.0  # uvicorn's deadline for the last responses, after the engine's drain


def uvicorn_config(app: FastAPI, config: ServeConfig, **options) -> uvicorn.Config:
    """uvicorn's settings for ``app``: connections that dawdle over their headers closed."""
    return uvicorn.Config(app, http=with_header_deadline(config.header_timeout), **options)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal drains the engine before uvicorn stops."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, engine: AsyncEngine,
                 grace_period: float) -> None:
        super().__init__(config)
        self.app, self.engine, self.grace_period = app, engine, grace_period
        self._draining = False
        self.engine_failed = False  # the engine stopped unasked: exit with status 1

    async def on_tick(self, counter: int) -> bool:
        if not self._draining and not self.engine.is_running and not self.engine_failed:
            logger.error("the engine has stopped; shutting down")
            self.engine_failed = True
            self.app.state.serving.draining = True  # (its requests have ended with 503s)
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining:  # a second signal: uvicorn's own exit (and the signal's status)
            super().handle_exit(sig, frame)
            return
        self._draining = True  # (runs in a signal handler: only start a thread here)
        self.app.state.serving.draining = True
        threading.Thread(target=self._drain, name="nanovllm-drain", daemon=True).start()

    def _drain(self) -> None:
        logger.info("draining: finishing requests in flight (up to %g s)", self.grace_period)
        self.engine.shutdown(wait=True, timeout=self.grace_period)
        if self.engine.is_running:
            logger.warning("grace period over: aborting the requests still running")
            self.engine.shutdown(wait=False)
        self.should_exit = True  # uvicorn lets the last responses go out, then returns


def serve(config: ServeConfig) -> None:
    """Build the engine for ``config`` and serve it until a shutdown signal."""
    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace" else 5,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("loading %s", config.model)
    engine = AsyncEngine.from_model(config.model, engine_process=config.engine_process,
                                    **config.engine_options())
    try:
        app = build_app(engine, config)
        uv_config = uvicorn_config(
            app, config, host=config.host, port=config.port, log_level=config.log_level,
            timeout_graceful_shutdown=SHUTDOWN_MARGIN,
        )
        server = DrainingServer(uv_config, app, engine, config.grace_period)
        server.run()
    finally:
        engine.shutdown(wait=False)
    if server.engine_failed:
        raise SystemExit(1)


class ServerThread:
    """An app served on ``host`` (a free port unless ``port`` is given) by a background
    thread; ``url`` is its address. Use as a context manager, or ``start``/``stop``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.app = app
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = self.socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        config = uvicorn_config(app, app.state.config, log_level=log_level,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True,
            name="nanovllm-server",
        )

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
