"""A tensor-parallel worker: one shard of the model, following rank 0 (chapter 09).

Rank 0's messages: "step" (a ``StepPlan`` to run through the forward pass and LM head),
"draft" (one pass of a speculative draft that is a model, chapter 14: the target's first
layers, or a draft model of which this rank holds a shard), "call" (a runner method) and
"stop".

Rank 0 starts these itself (``executor.py``). To spread ranks over several hosts, start one
per extra GPU with torch.distributed's environment variables, e.g. on a second host::

    RANK=1 LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \\
        python -m nanovllm.engine.worker

with rank 0's ``LLM(model, tensor_parallel_size=2)`` run under ``RANK=0 WORLD_SIZE=2`` and the
same address. The model folder must exist at the same path on every host.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch

from nanovllm import distributed
from nanovllm.engine.executor import STARTUP_TIMEOUT
from nanovllm.engine.shm_broadcast import MessageQueue


def _exit_when_stdin_closes() -> None:
    """Rank 0 holds our stdin's other end: end-of-file means it is gone (even if killed)."""
    sys.stdin.buffer.read()
    os._exit(1)


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0 to handle
    if os.environ.get("NANOVLLM_WORKER_STDIN_WATCH"):
        threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    store = distributed.open_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   rank, world_size, STARTUP_TIMEOUT)
    store.set(f"nanovllm/ready/{rank}", "1")
    # Rank 0 says where the model runs: every rank must use the same backend (NCCL or gloo).
    on_cuda = store.get("nanovllm/device_type").decode() == "cuda"
    device = torch.device(f"cuda:{local_rank}" if on_cuda else "cpu")
    distributed.init_tensor_parallel(store, rank, world_size, device)
    config, queue_handle = distributed.broadcast_object()
    # Rank 0 started this worker on its own host: steps come through shared memory.
    if queue_handle is not None:
        receive = MessageQueue.attach(queue_handle, reader=rank - 1).get
    else:
        receive = distributed.broadcast_object
    config.device = str(device) if config.device.startswith("cuda") else "cpu"
    if config.device == "cpu":  # share the cores with the other ranks instead of fighting
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    from nanovllm.engine.model_runner import ModelRunner  # (after the group: it reads tp_size)
    from nanovllm.engine.spec_decode.draft_model import DraftModelProposer
    from nanovllm.engine.spec_decode.speculator import make_proposer
    from nanovllm.models import ModelConfig

    runner = ModelRunner(config, ModelConfig.from_pretrained(config.model))
    # A draft that is a model (chapter 14) runs on every rank: this rank's side of it.
    spec = config.speculative_config
    drafter = None if spec is None or spec.method == "ngram" else make_proposer(spec, runner)
    while True:
        message = receive()
        if message[0] == "step":
            runner.follow(message[1])
            if isinstance(drafter, DraftModelProposer):  # as rank 0 after a verify pass
                drafter.follow_plan(message[1])
        elif message[0] == "draft":  # one pass of the draft's proposal loop
            drafter.run_pass(message[1])
        elif message[0] == "call":
            getattr(runner, message[1])(*message[2])
        else:  # "stop": leave the groups together with rank 0, then go
            runner.release_graphs()
            distributed.destroy_tensor_parallel(together=True)
            sys.stdout.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
