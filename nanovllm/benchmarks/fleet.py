"""Several engine replicas behind one router, in one process (chapter 17 §5).

``run_fleet`` replays a workload's arrivals against ``LLMEngine`` replicas: each request is
routed when it arrives, and each replica steps on its own clock, advanced by the measured
time of its own steps -- as if every replica had a device of its own, while this process
runs them one step at a time. On a GPU a step's time is wall-clock time (synchronized); on a
CPU it is this process's CPU time (all its threads), which other jobs on a shared machine
do not inflate. (Replicas that really share one device, or a CPU's cores,
would slow each other down; the clock leaves that out, on purpose: it compares routers, not
hardware.) A replica that is idle when a request arrives jumps its clock to the arrival.

``tenant_workload`` is the shared-prefix workload (``nanovllm/benchmarks/workload.py``) for
several tenants at once, each with its own system prompt: the traffic where a router's
choice of replica decides which prefixes each cache must hold.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from nanovllm.benchmarks.timing import synchronize
from nanovllm.benchmarks.workload import Workload, make_workload
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


def tenant_workload(tenants: int, per_tenant: int, *, length_scale: float = 1.0,
                    request_rate: float = 8.0, seed: int = 0) -> Workload:
    """``tenants`` shared-prefix workloads (seeds ``seed``, ``seed + 1``, ...: each its own
    system prompt) of ``per_tenant`` requests, shuffled together, arriving as a Poisson
    process of ``request_rate`` requests per second."""
    parts = [make_workload("shared-prefix", per_tenant, seed + t, length_scale=length_scale)
             for t in range(tenants)]
    pairs = [(p, n) for w in parts for p, n in zip(w.prompts, w.output_lens)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    clock, times = 0.0, []
    for _ in pairs:
        times.append(clock)
        clock += rng.expovariate(request_rate)
    return Workload([p for p, _ in pairs], [n for _, n in pairs], times,
                    shared_prefix_len=parts[0].shared_prefix_len)


@dataclass
class FleetResult:
    router: str
    num_replicas: int
    requests_per_replica: list[int]
    prompt_tokens: int
    cached_prompt_tokens: int  # found in a replica's prefix cache
    output_tokens: int
    seconds: float  # first arrival to last finish, on the replicas' clocks (module docstring)
    ttft: list[float] = field(repr=False)  # per request, arrival to first token

    @property
    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens

    @property
    def throughput(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.seconds

    def summary(self) -> dict:
        ttft = sorted(self.ttft)
        return {"router": self.router, "num_replicas": self.num_replicas,
                "requests_per_replica": self.requests_per_replica,
                "prefix_hit_rate": round(self.hit_rate, 4),
                "prompt_tokens": self.prompt_tokens,
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "output_tokens": self.output_tokens, "seconds": round(self.seconds, 4),
                "output_tokens_per_s": round(self.throughput, 2),
                "ttft_mean_s": round(sum(ttft) / len(ttft), 5),
                "ttft_p50_s": round(ttft[len(ttft) // 2], 5),
                "ttft_p90_s": round(ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 5)}


def run_fleet(engines: list[LLMEngine], router, work: Workload) -> FleetResult:
    """Replay ``work`` (greedy, each request to its fixed length) on ``engines`` through
    ``router`` (``route(token_ids) -> replica``, ``finished(replica)``); see the module
    docstring for the clocks. The engines' prefix caches should start empty."""
    n = len(engines)
    arrivals = work.arrival_times or [0.0] * len(work.prompts)
    order = sorted(range(len(work.prompts)), key=arrivals.__getitem__)
    clocks = [0.0] * n
    before = [(e.block_manager.queried_tokens, e.block_manager.hit_tokens) for e in engines]
    owner: dict[str, int] = {}
    first_token: dict[str, float] = {}
    counts = [0] * n
    device = engines[0].config.device
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    next_arrival = 0
    while next_arrival < len(order) or any(e.has_unfinished_requests() for e in engines):
        busy = [r for r in range(n) if engines[r].has_unfinished_requests()]
        stepper = min(busy, key=clocks.__getitem__) if busy else None
        if next_arrival < len(order) and (
                stepper is None or arrivals[order[next_arrival]] <= clocks[stepper]):
            i = order[next_arrival]
            replica = router.route(work.prompts[i])
            if not engines[replica].has_unfinished_requests():
                clocks[replica] = max(clocks[replica], arrivals[i])
            params = SamplingParams(temperature=0, max_tokens=work.output_lens[i],
                                    ignore_eos=True)
            engines[replica].add_request(str(i), work.prompts[i], params)
            owner[str(i)], counts[replica] = replica, counts[replica] + 1
            next_arrival += 1
            continue
        start = clock()
        outputs = engines[stepper].step()
        synchronize(device)
        clocks[stepper] += clock() - start
        for out in outputs:
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = clocks[stepper]
            if out.finished:
                router.finished(owner[out.request_id])
    queried = sum(e.block_manager.queried_tokens - q for e, (q, _) in zip(engines, before))
    hits = sum(e.block_manager.hit_tokens - h for e, (_, h) in zip(engines, before))
    ttft = [first_token[str(i)] - arrivals[i] for i in range(len(work.prompts))]
    return FleetResult(router.name, n, counts, queried, hits, work.output_tokens,
                       max(clocks) - min(arrivals), ttft)
