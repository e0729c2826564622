"""Tensor-parallel workers placed by Ray: ``LLM(..., tensor_parallel_size=N,
distributed_executor_backend="ray")`` (vLLM's option; chapter 17 §4).

The home-made launcher (``engine/executor.py``) starts ranks 1..N-1 as child processes of
rank 0, on rank 0's host. On a cluster the nodes belong to Ray: this executor reserves a
*placement group* of N bundles (one per rank: a GPU, or a CPU core on a CPU engine), keeps
bundle 0 for rank 0 (this process) and starts in each other bundle a small actor whose only
job is to run the ordinary worker process (``python -m nanovllm.engine.worker``) on its
node, with torch.distributed's variables pointing at rank 0. From there everything is the
home-made path's: the same store, the same process groups (NCCL between GPUs, gloo on CPU),
every step sent over gloo (other nodes share no memory with rank 0), the same
``WorkerDiedError`` when a worker goes -- a dead actor or a worker that exited is noticed by
``check_workers`` before the next step, or after a collective fails, never a hang.

Not run here on GPUs or across nodes (this machine has neither): on a GPU cluster each
worker sees its one GPU as ``cuda:0`` (Ray sets ``CUDA_VISIBLE_DEVICES``); rank 0 uses its
own, and must not share it with a worker, which bundle 0 (not handed to any actor) ensures
when the driver's GPU is the only one Ray leaves unassigned on its node.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import weakref

import torch

from nanovllm import distributed
from nanovllm.config import EngineConfig
from nanovllm.engine.executor import (
    STARTUP_TIMEOUT,
    STOP_TIMEOUT,
    TPExecutor,
    _worker_command,
    free_port,
)


class _Launcher:
    """A Ray actor that runs one worker process on its node and reports how it ended."""

    def start(self, env: dict[str, str], gpu: bool) -> int:
        full = dict(os.environ, **env)
        if gpu:  # Ray gave this actor one GPU, visible as the only one
            full["LOCAL_RANK"] = "0"
        self.proc = subprocess.Popen(_worker_command(), env=full, stdin=subprocess.PIPE)
        return self.proc.pid

    def wait(self) -> int:
        return self.proc.wait()


class RayWorker:
    """Rank 0's handle on one Ray-placed worker, shaped like ``subprocess.Popen``
    (``pid``, ``poll``) so that ``TPExecutor``'s checks work unchanged."""

    def __init__(self, actor, rank: int, env: dict[str, str], gpu: bool) -> None:
        import ray

        self.actor, self.rank = actor, rank
        self.pid = ray.get(actor.start.remote(env, gpu), timeout=STARTUP_TIMEOUT)
        self.exit = actor.wait.remote()  # resolves when the worker process ends

    def poll(self) -> int | None:
        """None while the worker runs; its exit status once it has ended (-9 if its actor
        or node died)."""
        import ray

        ready, _ = ray.wait([self.exit], timeout=0)
        if not ready:
            return None
        try:
            return ray.get(self.exit)
        except ray.exceptions.RayError:  # the actor, or its node, is gone
            return -9


class RayExecutor(TPExecutor):
    """``TPExecutor`` whose workers Ray places (module docstring)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = config.tensor_parallel_size
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        on_gpu = device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        group = placement_group([bundle] * n, strategy="PACK")
        ray.get(group.ready(), timeout=STARTUP_TIMEOUT)
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        store = distributed.open_store(host, port, 0, n, STARTUP_TIMEOUT)
        store.set("nanovllm/device_type", device.type)
        launcher = ray.remote(num_cpus=1, num_gpus=1 if on_gpu else 0)(_Launcher)
        self.queue = None  # steps go over gloo: a worker may be on another node
        self.workers: list[RayWorker] = []
        self._finalizer = weakref.finalize(self, _stop, self.workers, group,
                                           remove_placement_group)
        try:
            for rank in range(1, n):
                actor = launcher.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank)).remote()
                env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                       "MASTER_ADDR": host, "MASTER_PORT": str(port),
                       "NANOVLLM_WORKER_STDIN_WATCH": "1", "NCCL_NVLS_ENABLE": "0"}
                self.workers.append(RayWorker(actor, rank, env, on_gpu))
            self._wait_for_workers(store, n)
            distributed.init_tensor_parallel(store, 0, n, device)
            # (as TPExecutor: a user's policy object stays here, only rank 0 schedules)
            worker_config = dataclasses.replace(config, scheduler_policy="fcfs")
            distributed.broadcast_object((worker_config, None))
        except BaseException:
            self.shutdown(polite=False)
            raise


def _stop(workers: list[RayWorker], group, remove_placement_group) -> None:
    """Give the workers ``STOP_TIMEOUT`` to exit (after "stop" they do by themselves), then
    kill their actors (a worker whose actor is gone sees its stdin close and exits) and free
    the placement group."""
    import ray

    if workers:
        ray.wait([w.exit for w in workers], num_returns=len(workers), timeout=STOP_TIMEOUT)
    for worker in workers:
        ray.kill(worker.actor)
    remove_placement_group(group)
