"""Copies between host and device that do not make the CPU wait for the GPU (chapter 11):
a step's inputs go up through pinned memory, its results come down into pinned memory with an
event recorded after them, so that planning the next step overlaps the device's work."""

from __future__ import annotations

import numpy as np
import torch

from nanovllm.engine.step import InFlight


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor ``t`` in page-locked host memory, queued, not waited for."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> device tensor without making the CPU wait for the GPU: through pinned
    memory, since from ordinary memory the driver may first wait for the GPU's queue to drain
    (with async scheduling it holds the step being computed). PyTorch caches pinned blocks."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def queue_to_host(step: InFlight, logprobs: list, prompt: list, device: torch.device) -> InFlight:
    """Queue the copies of the step's results to the host, and an event after them."""
    tensors = ([step.tokens] if step.tokens is not None else []) + logprobs
    tensors += [t for _, _, columns in prompt for t in columns]
    if device.type == "cuda":
        tensors = [pinned_copy(t) for t in tensors]
        step.done = torch.cuda.Event()
        step.done.record()
    if step.tokens is not None:
        step.tokens, tensors = tensors[0], tensors[1:]
    step.logprobs, tensors = tensors[: len(logprobs)], tensors[len(logprobs) :]
    for seq, position, _ in prompt:
        step.prompt_logprobs.append((seq, position, tensors[:4]))
        tensors = tensors[4:]
    return step
