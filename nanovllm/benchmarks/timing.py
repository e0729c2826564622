"""How the benchmarks time things: a host clock around synchronized work, or CUDA events.

GPU work is asynchronous: a launch returns before its kernels run, so a host clock read right
after it measures the launch, not the work. Every helper here waits for the device
(``synchronize``) before it reads the clock, or, with ``events=True``, times each call on the
device itself with CUDA events (without the host's launch cost, which CUDA graphs hide in the
engine; chapter 07). Warm-up calls run first, untimed: Triton compiles a kernel on its first
call (chapter 05), and allocators and caches settle. Kernels alone are timed with Triton's
``do_bench`` instead (``decode_kernel``, ``prefill_kernel``), which also clears the L2.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

Device = str | torch.device | None  # None: nothing to wait for (host work only)


def synchronize(device: Device) -> None:
    """Wait until ``device`` has finished the work queued on it (nothing to do on a CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Stopwatch:
    seconds: float = float("nan")  # set when the ``with`` block ends


@contextmanager
def stopwatch(device: Device = None) -> Iterator[Stopwatch]:
    """``with stopwatch("cuda") as watch: ...``, then ``watch.seconds``: the wall time of the
    block, with ``device`` synchronized before the clock starts and before it stops."""
    watch = Stopwatch()
    synchronize(device)
    start = time.perf_counter()
    yield watch
    synchronize(device)
    watch.seconds = time.perf_counter() - start


def time_calls(
    fn: Callable[[], object],
    reps: int,
    warmup: int = 3,
    device: Device = None,
    *,
    events: bool = False,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn``, after ``warmup`` untimed ones.

    Each call is timed on its own: by default with the host clock and ``device`` synchronized
    around it (launch included); with ``events=True`` on a CUDA device, by CUDA events recorded
    around it, all calls queued back to back (device time only). ``before`` runs ahead of each
    call, outside its timing (e.g. flushing the L2 cache)."""
    for _ in range(warmup):
        fn()
    if events and device is not None and torch.device(device).type == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(reps)]
        for start, end in pairs:
            if before is not None:
                before()
            start.record()
            fn()
            end.record()
        synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in pairs]
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        with stopwatch(device) as watch:
            fn()
        times.append(watch.seconds)
    return times


def time_loop(fn: Callable[[], object], iters: int, warmup: int = 3, device: Device = None
              ) -> float:
    """Mean seconds per call of ``fn`` run ``iters`` times back to back (one synchronized
    stopwatch around the whole loop), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    with stopwatch(device) as watch:
        for _ in range(iters):
            fn()
    return watch.seconds / iters
