"""Tensor-parallel state: which shard of each weight this process owns (chapter 09).

With one process (the default) rank is 0 and size is 1, and every helper here is a no-op,
so the layers are written once for both cases. With ``tensor_parallel_size=N`` each of the
N processes calls ``init_tensor_parallel`` once, before it builds its model: from then on
``tp_rank()``/``tp_size()`` say which slice of every weight it holds, ``all_reduce`` sums
partial results over the N ranks (NCCL between GPUs, gloo between CPU processes), and
``broadcast_object`` carries the engine's step plans from rank 0 to the others over a
separate gloo group, so control messages never queue behind GPU work.

The ranks meet through a ``TCPStore`` that rank 0 hosts, at ``MASTER_ADDR:MASTER_PORT``
(torch.distributed's own environment variables), so ranks may run on several hosts.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

# Control messages wait as long as rank 0 is idle (a server between requests): no timeout.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# One collective of the forward pass: a peer that is gone fails it long before this.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)

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
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _state.update(rank=rank, size=world_size, control=control)


def destroy_tensor_parallel(timeout: float = 10.0) -> bool:
    """Leave the process groups; back to one rank. False if tearing down NCCL hung for
    ``timeout`` seconds (it can, with peers already gone): the state is reset anyway."""
    _state.update(rank=0, size=1, control=None)
    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, daemon=True, name="nanovllm-tp-destroy").start()
    return done.wait(timeout)


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, n: int) -> None:
    """Raise ``ValueError`` unless a model's heads and MLP split evenly over ``n`` ranks."""
    for what, size in (("attention heads", num_heads), ("KV heads", num_kv_heads),
                       ("MLP features (intermediate_size)", intermediate_size)):
        if size % n:
            raise ValueError(
                f"tensor_parallel_size={n} does not divide the model's {size} {what}; choose "
                f"a size that divides {num_heads} heads and {num_kv_heads} KV heads"
            )
