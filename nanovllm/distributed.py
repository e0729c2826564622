"""Tensor-parallel state: which shard of each weight this process owns (chapter 09).

With one process (the default) rank is 0 and size is 1, and every helper here is a no-op,
so the layers are written once for both cases. With ``tensor_parallel_size=N`` each of the
N processes calls ``init_tensor_parallel`` once, before it builds its model: from then on
``tp_rank()``/``tp_size()`` say which slice of every weight it holds, ``all_reduce`` sums
partial results over the N ranks (NCCL between GPUs, gloo between CPU processes), and
``broadcast_object`` carries control messages from rank 0 to the others over a separate
gloo group, so that they never queue behind GPU work: the engine's configuration, and its
step plans to ranks on other hosts (workers on rank 0's host read theirs from shared
memory, ``engine/shm_broadcast.py``).

The ranks meet through a ``TCPStore`` that rank 0 hosts, at ``MASTER_ADDR:MASTER_PORT``
(torch.distributed's own environment variables), so ranks may run on several hosts.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

# Control messages wait as long as rank 0 is idle (a server between requests): no timeout.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# One collective of the forward pass: a peer that is gone fails it long before this.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)

logger = logging.getLogger("nanovllm")
_state: dict = {"rank": 0, "size": 1, "control": None}


def tp_rank() -> int:
    return _state["rank"]


def tp_size() -> int:
    return _state["size"]


@contextmanager
def as_single_rank() -> Iterator[None]:
    """Pretend to be the only rank while building a model (its full, unsharded shapes)."""
    saved = dict(_state)
    _state.update(rank=0, size=1)
    try:
        yield
    finally:
        _state.update(saved)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (the LM head's vocab slices)."""
    if tp_size() == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(shards, x)
    return torch.cat(shards, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` any rank holds (e.g. how many KV blocks every rank can fit)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere), in place."""
    if tp_size() > 1:
        dist.broadcast(x, src=0)
    return x


def broadcast_object(obj: object = None) -> object:
    """Rank 0 sends ``obj`` (pickled); the other ranks pass nothing and receive it."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_state["control"])
    return box[0]


def open_store(host: str, port: int, rank: int, world_size: int, timeout: float):
    """Rank 0 hosts the rendezvous store; the others connect to it (waiting up to ``timeout``)."""
    return dist.TCPStore(
        host, port, world_size, is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False,
    )


def init_tensor_parallel(store, rank: int, world_size: int, device: torch.device) -> None:
    """Join the ranks' process groups: NCCL (GPU) or gloo (CPU) for the model's collectives,
    gloo for control messages. Every rank calls this with the same ``world_size``."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process: one tensor-parallel "
            "engine per process (shut the other one down first: llm.shutdown())"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # By default PyTorch's NCCL watchdog kills the process when a peer fails; rank 0 is
        # the user's process, so it reports the lost worker instead (executor.py).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _state.update(rank=rank, size=world_size, control=control)


def destroy_tensor_parallel(together: bool, timeout: float = 10.0) -> bool:
    """Leave the process groups; back to one rank. ``together``: every rank is calling this
    at the same time (a clean shutdown), so NCCL can tear its communicators down in step;
    otherwise (a rank is gone) they are aborted, which needs no peer. False if that failed
    or hung for ``timeout`` seconds: the process then cannot start another TP engine."""
    _state.update(rank=0, size=1, control=None)
    if not dist.is_initialized():
        return True
    done, failed = threading.Event(), []

    def teardown() -> None:
        try:
            if together or dist.get_backend() != "nccl":
                dist.destroy_process_group()
            else:
                dist.distributed_c10d._abort_process_group()
        except Exception as err:  # noqa: BLE001 -- reported below
            failed.append(err)
        finally:
            done.set()

    threading.Thread(target=teardown, daemon=True, name="nanovllm-tp-teardown").start()
    finished = done.wait(timeout)
    if failed or not finished:
        logger.warning("leaving the tensor-parallel process groups %s; forgetting them",
                       f"failed: {failed[0]!r}" if failed else f"hung for {timeout:.0f} s")
        _forget_process_groups()
    return finished and not failed


def _forget_process_groups() -> None:
    """Drop torch.distributed's registry of groups whose teardown hung (NCCL can, after
    CUDA graphs captured its collectives), so that this process may start another TP
    engine; the old communicators stay with the stuck thread. (torch's own abort path
    clears the same registry; there is no public call for it.)"""
    c10d = dist.distributed_c10d
    c10d._update_default_pg(None)
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
                  "tags_to_pg", "pg_coalesce_state"):
        getattr(c10d._world, table).clear()
    c10d._unregister_all_process_groups()
    c10d._world.group_count = 0


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, n: int,
                    model: str = "the model") -> None:
    """Raise ``ValueError`` unless a model's heads and MLP split evenly over ``n`` ranks
    (``model`` names it in the message, e.g. a speculative draft, chapter 14)."""
    for what, size in (("attention heads", num_heads), ("KV heads", num_kv_heads),
                       ("MLP features (intermediate_size)", intermediate_size)):
        if size % n:
            raise ValueError(
                f"tensor_parallel_size={n} does not divide {model}'s {size} {what}; choose "
                f"a size that divides {num_heads} heads and {num_kv_heads} KV heads"
            )
