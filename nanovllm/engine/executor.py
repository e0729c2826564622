"""Rank 0's side of tensor parallelism: start the workers, send them every step (chapter 09).

Rank 0 runs the scheduler, the sampler and shard 0; workers (``worker.py``) hold the other
shards. Each step rank 0 sends a small ``StepPlan`` (through shared memory, ``shm_broadcast.py``;
over gloo to ranks on other hosts), then all ranks run the same forward pass in lockstep.
Hygiene, as leaked GPU processes are the classic failure of multi-process engines: a free port
unless ``MASTER_PORT`` is set; workers ignore Ctrl-C and exit when their stdin (a pipe from rank
0) closes; ``shutdown`` (also at garbage collection and exit) stops them, killing stragglers;
a dead worker raises ``WorkerDiedError`` before the next step or when a collective loses it.
With ``WORLD_SIZE`` set (torchrun, cluster launchers) rank 0 starts no workers and waits for
``python -m nanovllm.engine.worker`` processes started elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch

from nanovllm import distributed
from nanovllm.config import EngineConfig
from nanovllm.engine.shm_broadcast import MessageQueue

STARTUP_TIMEOUT = 300.0  # seconds for every worker to join (imports, CUDA init, weights)
STOP_TIMEOUT = 10.0  # seconds a worker gets to exit before it is killed


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited: the engine cannot run another step."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker_command() -> list[str]:
    """``python -m nanovllm.engine.worker``, importing the same ``nanovllm`` as this process:
    ``-m`` would put the current folder first on ``sys.path``, and a course grader runs in
    the reference tree while the student's package is the one imported here."""
    root = str(Path(__file__).resolve().parents[2])  # this file is <root>/nanovllm/engine/
    boot = f"import sys; sys.path.insert(0, {root!r}); import nanovllm.engine.worker as w; w.main()"
    return [sys.executable, "-c", boot]


def _worker_env(rank: int, world_size: int, host: str, port: int) -> dict[str, str]:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               MASTER_ADDR=host, MASTER_PORT=str(port), NANOVLLM_WORKER_STDIN_WATCH="1")
    # NVLink multicast (NVLS) is not available on every machine: keep NCCL on plain NVLink.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


class TPExecutor:
    """Starts ``tensor_parallel_size - 1`` workers and speaks for rank 0 to them."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        n = config.tensor_parallel_size
        external = "WORLD_SIZE" in os.environ  # ranks started by a launcher, maybe elsewhere
        if external and int(os.environ["WORLD_SIZE"]) != n:
            raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} in the environment but "
                             f"tensor_parallel_size={n}")
        if external and int(os.environ.get("RANK", "0")) != 0:
            raise ValueError("LLM(...) runs on rank 0 only; start the other ranks with "
                             "`python -m nanovllm.engine.worker`")
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else free_port(host)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        store = distributed.open_store(host, port, 0, n, STARTUP_TIMEOUT)
        store.set("nanovllm/device_type", device.type)
        self.workers: list[subprocess.Popen] = []
        # Steps go through shared memory to the workers started here (this host), over
        # gloo to ranks a launcher started, which may be on other hosts.
        self.queue = None if external else MessageQueue.create(num_readers=n - 1)
        if not external:
            for rank in range(1, n):
                self.workers.append(subprocess.Popen(
                    _worker_command(), env=_worker_env(rank, n, host, port), stdin=subprocess.PIPE))
        # Stop the workers even if nobody calls shutdown (the engine is dropped, or the
        # interpreter exits): this holds no reference to self, only to the process list.
        self._finalizer = weakref.finalize(self, _stop, self.workers, self.queue)
        try:
            self._wait_for_workers(store, n)
            distributed.init_tensor_parallel(store, 0, n, device)
            # Workers need the config; a user's policy object stays here (only rank 0
            # schedules) -- it may not even be importable in another process.
            worker_config = dataclasses.replace(config, scheduler_policy="fcfs")
            handle = self.queue.handle() if self.queue is not None else None
            distributed.broadcast_object((worker_config, handle))
            if self.queue is not None:
                self.queue.wait_until_attached(self.check_workers)
        except BaseException:
            self.shutdown(polite=False)
            raise

    def _wait_for_workers(self, store, n: int) -> None:
        """Wait until every rank has checked in at the store, failing fast if one dies."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        keys = [f"nanovllm/ready/{rank}" for rank in range(1, n)]
        while not store.check(keys):
            self.check_workers()
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel workers did not join within "
                                   f"{STARTUP_TIMEOUT:.0f} s")
            time.sleep(0.05)

    def check_workers(self) -> None:
        """Raise ``WorkerDiedError`` if a worker process has exited."""
        for rank, proc in enumerate(self.workers, start=1):
            code = proc.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                                      f"ended with {how}; the engine cannot continue (its "
                                      "traceback, if any, is above)")

    def raise_if_a_worker_died(self, wait: float = 2.0) -> None:
        """After a failed step: raise ``WorkerDiedError`` if a worker is gone or goes within
        ``wait`` seconds (a collective can notice the lost peer before the exit is reaped)."""
        deadline = time.monotonic() + wait
        while True:
            self.check_workers()
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def send(self, message: tuple) -> None:
        """Send one message to every worker (after checking they are all alive)."""
        self.check_workers()
        if self.queue is not None:
            self.queue.put(message, check=self.check_workers)
        else:
            distributed.broadcast_object(message)

    def wait_for(self, event: torch.cuda.Event) -> None:
        """``event.synchronize()``, except that a worker's death raises instead of hanging
        (its peers' NCCL kernels would wait for it forever)."""
        checked = time.monotonic()
        while not event.query():
            if time.monotonic() - checked > 0.1:
                self.check_workers()
                checked = time.monotonic()
            time.sleep(50e-6)

    def shutdown(self, polite: bool = True) -> None:
        """Stop the workers and leave the process groups. ``polite``: tell them to stop and
        leave together; otherwise (start-up failed: a worker may be stuck in a collective
        that rank 0 will never join) just close their stdin and kill what lingers."""
        if not self._finalizer.alive:
            return
        together = (polite and distributed.tp_size() > 1
                    and all(p.poll() is None for p in self.workers))
        if together:
            try:
                self.send(("stop",))
            except RuntimeError:  # a worker went away meanwhile (WorkerDiedError, gloo's)
                together = False
        distributed.destroy_tensor_parallel(together)  # the workers leave theirs meanwhile
        self._finalizer()


def _stop(workers: list[subprocess.Popen], queue: MessageQueue | None) -> None:
    if queue is not None:
        queue.close()
    for proc in workers:
        if proc.stdin is not None:
            proc.stdin.close()  # end-of-file: the worker's watch thread exits it
    deadline = time.monotonic() + STOP_TIMEOUT
    for proc in workers:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
