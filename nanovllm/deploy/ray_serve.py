"""Data-parallel replicas behind one OpenAI endpoint, with Ray Serve (chapter 17 §4).

    python -m nanovllm.deploy.ray_serve MODEL --num-replicas 2 --port 8000 [serve's options]

Every option of ``nanovllm serve`` works here too (``--config``, ``--api-key``, engine
flags); ``--num-replicas``, ``--num-cpus-per-replica``, ``--num-gpus-per-replica`` and
``--ray-address`` (an existing cluster; default: start a local one) are Ray's. SIGTERM or
Ctrl-C (also while the replicas start) stops them, each draining, then leaves the cluster
(a local one stops with it); the exit status is 0.

The design, chosen for the least new code: **each replica is a whole ``nanovllm serve``**.
A Ray Serve deployment of ``num_replicas`` replicas (Ray actors, placed anywhere on the
cluster) builds in each one an ``AsyncEngine`` and, over it, the very FastAPI app of
``serve/app.py`` (``build_app``), through Ray's late-bound ingress
(``@serve.ingress()`` with ``__serve_build_asgi_app__``: the app is built on the replica,
after its engine). Ray Serve's HTTP proxy is the one endpoint: it passes each HTTP request,
streamed or not, to a replica's copy of the app. So authentication, admission (429s),
streaming, ``/metrics`` and errors are the single server's, unchanged, per replica. The
other design -- the existing app in front, with an engine handle that forwards to Ray --
would have to re-implement what the app reads from its engine (tokenizer, config, load,
stats) across a process boundary.

Routing is Ray Serve's default (power of two choices on requests in flight), not our
prefix-aware router (``router.py``): Ray's request router (``ray.serve.request_router``,
alpha) runs in the proxy before the body is read -- it sees the request's headers and path,
not its prompt. Routing on prefixes would take a second deployment in front that reads and
tokenizes the body and calls the replicas through a handle (what ``ray.serve.llm``'s
``PrefixCacheAffinityRouter`` needs); chapter 17 §5 measures what it would gain.

Each response names its replica in an ``x-nanovllm-replica`` header. Ray's health check asks
the replica whether its engine still runs (a dead one is replaced); a replica that Ray stops
gets ``grace_period`` seconds to finish its requests (``graceful_shutdown_timeout_s``) before
its engine aborts what is left. Ray caps each replica's requests in flight
(``max_ongoing_requests``) at what its engine may hold (``max_num_seqs`` +
``max_queue_depth``): the app's own admission answers 429 first. Written against Ray 2.60:
the late-bound ingress (``serve.ingress()`` given no app) is recent (2026).
"""

from __future__ import annotations

import argparse
import signal
import sys

import ray
from fastapi import FastAPI
from ray import serve

from nanovllm.config import EngineConfig
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.serve.app import build_app
from nanovllm.serve.cli import add_serve_arguments, config_from_args
from nanovllm.serve.config import ConfigError, ServeConfig

APP_NAME = "nanovllm"
REPLICA_HEADER = "x-nanovllm-replica"
UNBOUNDED_QUEUE = 1024  # requests in flight per replica when the app's queue has no cap


@serve.ingress()
class EngineReplica:
    """One replica: an ``AsyncEngine`` and ``nanovllm serve``'s app over it."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.engine = AsyncEngine.from_model(config.model, engine_process=config.engine_process,
                                             **config.engine_options())
        self.name = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_app(self.engine, self.config)
        app.add_middleware(NameReplica, name=self.name)
        return app

    def check_health(self) -> None:
        """Ray's periodic health check: an engine that has stopped fails it."""
        if not self.engine.is_running:
            raise RuntimeError("the engine has stopped")

    def __del__(self) -> None:
        # Ray has let the requests in flight finish (graceful_shutdown_timeout_s)
        engine = getattr(self, "engine", None)  # (None: building it failed)
        if engine is not None:
            engine.shutdown(wait=False)


class NameReplica:
    """ASGI middleware: every HTTP response says which replica answered it."""

    def __init__(self, app, name: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, named)


def replicas(config: ServeConfig, num_replicas: int, num_cpus: float = 1.0,
             num_gpus: float = 0.0):
    """The Ray Serve application: ``num_replicas`` replicas of ``config``'s server, each
    reserving ``num_cpus`` CPUs and ``num_gpus`` GPUs (a fraction shares a GPU)."""
    max_num_seqs = config.engine.get("max_num_seqs", EngineConfig.max_num_seqs)
    queue = UNBOUNDED_QUEUE if config.max_queue_depth is None else config.max_queue_depth
    deployment = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=max_num_seqs + queue,
        graceful_shutdown_timeout_s=config.grace_period,
    )
    return deployment.bind(config)


def start(config: ServeConfig, num_replicas: int, num_cpus: float = 1.0,
          num_gpus: float = 0.0) -> str:
    """Start Serve's HTTP proxy on ``config.host:config.port`` and deploy the replicas on
    the Ray cluster this process is connected to; returns the endpoint's URL once every
    replica is ready. ``stop()`` undoes it."""
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(replicas(config, num_replicas, num_cpus, num_gpus), name=APP_NAME,
              route_prefix="/")
    return f"http://{config.host}:{config.port}"


def stop() -> None:
    """Delete the replicas (each drains, see the module docstring) and stop Serve (nothing
    to do once this process has left its Ray cluster)."""
    if ray.is_initialized():
        serve.shutdown()


def main(argv: list[str] | None = None) -> int:
    """The command line (the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m nanovllm.deploy.ray_serve",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    parser.add_argument("--num-replicas", type=int, default=2, help="engine replicas")
    parser.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--num-gpus-per-replica", type=float, default=None,
                        help="a fraction shares a GPU (default: tensor-parallel size on a "
                        "cluster with GPUs, else 0)")
    parser.add_argument("--ray-address", help="an existing Ray cluster (default: RAY_ADDRESS, "
                        "or a local cluster started here)")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    ray.init(address=args.ray_address, include_dashboard=False)
    num_gpus = args.num_gpus_per_replica
    if num_gpus is None:
        tp = config.engine.get("tensor_parallel_size", 1)
        num_gpus = tp if ray.cluster_resources().get("GPU", 0) else 0
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: also while the replicas start
    try:
        url = start(config, args.num_replicas, args.num_cpus_per_replica, num_gpus)
        print(f"{args.num_replicas} replicas of {config.model} at {url}/v1", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass  # a shutdown that was asked for: drain (stop), exit 0
    finally:
        stop()
        ray.shutdown()
    return 0


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
