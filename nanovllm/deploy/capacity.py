"""How many replicas a day of traffic needs, and what a queue-depth autoscaler does over that
day (chapter 17 §6). Both are arithmetic on one server's measured latency-vs-rate curve
(``figures/data/serve_h200.json``: ``nanovllm.benchmarks.serve`` against one H200 replica);
the autoscaler's day is a simulation, and labelled as one.

- ``LatencyCurve``: TTFT and TPOT (p90) at each offered rate, linear in between, and the
  saturation throughput (the all-at-once run's requests per second);
- ``max_rate``: the highest rate one replica serves within a TTFT/TPOT SLO;
- ``day_trace``: a day of arrival rates (trough at 04:00, peak at 16:00, seeded noise);
- ``replicas_needed``: the planner's answer for each moment, ``ceil(rate / max_rate)``;
- ``simulate_hpa``: Kubernetes' rule on the waiting-queue metric (``k8s/hpa.yaml``) over a
  fluid queue: arrivals fill it, ``ready`` replicas drain it at the saturation rate, new
  replicas serve only after ``startup_s`` (loading weights), scale-down waits out a window,
  and each way at most so many pods change per period (the manifest's rate policies).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LatencyCurve:
    rates: list[float]  # offered requests/s, increasing
    ttft_p90: list[float]  # seconds
    tpot_p90: list[float]  # seconds
    e2e_mean: list[float]  # seconds, arrival to last token
    saturation_rps: float  # the most requests/s one replica completes

    @classmethod
    def from_record(cls, path: str | Path) -> LatencyCurve:
        """From a ``nanovllm.benchmarks.serve`` record: its finite-rate runs, and its
        all-at-once run (rate "inf") as the saturation throughput."""
        runs = json.loads(Path(path).read_text())["runs"]
        finite = sorted((r for r in runs if r["rate"] != "inf"), key=lambda r: r["rate"])
        burst = [r["request_throughput_rps"] for r in runs if r["rate"] == "inf"]
        saturation = max(burst or [r["request_throughput_rps"] for r in runs])
        return cls([r["rate"] for r in finite], [r["ttft"]["p90"] for r in finite],
                   [r["tpot"]["p90"] for r in finite], [r["e2e"]["mean"] for r in finite],
                   saturation)

    def at(self, rate: float) -> tuple[float, float]:
        """(TTFT p90, TPOT p90) at ``rate``: linear between measured rates, the nearest
        measured value outside them."""
        return self._interpolate(rate, self.ttft_p90), self._interpolate(rate, self.tpot_p90)

    def in_flight(self, rate: float) -> float:
        """Requests one replica holds at ``rate`` (Little's law: rate x mean latency)."""
        return rate * self._interpolate(rate, self.e2e_mean)

    def _interpolate(self, rate: float, values: list[float]) -> float:
        xs = self.rates
        if rate <= xs[0]:
            return values[0]
        for i in range(1, len(xs)):
            if rate <= xs[i]:
                w = (rate - xs[i - 1]) / (xs[i] - xs[i - 1])
                return values[i - 1] + w * (values[i] - values[i - 1])
        return values[-1]

    def max_rate(self, ttft_slo: float, tpot_slo: float, step: float = 0.01) -> float:
        """The highest rate (to ``step``) whose latencies meet both SLOs, at most the
        saturation throughput; 0 if even the lowest measured rate misses them."""
        def meets(rate: float) -> bool:
            ttft, tpot = self.at(rate)
            return ttft <= ttft_slo and tpot <= tpot_slo

        if not meets(self.rates[0]):
            return 0.0
        lo, hi = self.rates[0], self.saturation_rps
        if meets(hi):
            return hi
        while hi - lo > step:  # (latency rises with rate: bisect)
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if meets(mid) else (lo, mid)
        return lo


def day_trace(peak_rps: float, trough_rps: float, step_s: float = 60.0, noise: float = 0.1,
              seed: int = 0) -> list[float]:
    """Arrival rates (requests/s) for each ``step_s`` of one day: a raised cosine from
    ``trough_rps`` at 04:00 to ``peak_rps`` at 16:00, times 1 +- ``noise`` (uniform)."""
    rng = random.Random(seed)
    steps = round(86400 / step_s)
    rates = []
    for i in range(steps):
        hours = i * step_s / 3600
        shape = 0.5 * (1 - math.cos(2 * math.pi * (hours - 4) / 24))
        rates.append((trough_rps + (peak_rps - trough_rps) * shape)
                     * (1 + rng.uniform(-noise, noise)))
    return rates


def replicas_needed(trace: list[float], per_replica_rps: float, minimum: int = 1) -> list[int]:
    """The planner: enough replicas that each gets at most ``per_replica_rps``."""
    return [max(minimum, math.ceil(rate / per_replica_rps)) for rate in trace]


@dataclass
class HPARule:
    """The parts of an autoscaling/v2 HorizontalPodAutoscaler this simulation follows: the
    targets, the replica bounds, one ``Pods`` rate policy each way and scale-down's
    stabilization window."""

    target_waiting: float  # averageValue of the per-pod waiting metric
    target_running: float | None  # ... of the running metric (None: not scaled on)
    min_replicas: int
    max_replicas: int
    scale_up_pods: int  # at most this many pods added per scale_up_period_s
    scale_up_period_s: float
    scale_down_window_s: float  # stabilization: the highest wish over this window rules
    scale_down_pods: int  # at most this many pods removed per scale_down_period_s
    scale_down_period_s: float
    sync_s: float = 15.0  # the controller's period (kube-controller-manager's default)
    startup_s: float = 180.0  # a new pod's start: image, weights, kernels, /health

    @classmethod
    def from_manifest(cls, hpa: dict, **overrides) -> HPARule:
        spec = hpa["spec"]
        targets = {m["pods"]["metric"]["name"]: float(m["pods"]["target"]["averageValue"])
                   for m in spec["metrics"] if m["type"] == "Pods"}
        (up,) = spec["behavior"]["scaleUp"]["policies"]
        (down,) = spec["behavior"]["scaleDown"]["policies"]
        if up["type"] != "Pods" or down["type"] != "Pods":
            raise ValueError("the simulation follows Pods policies only")
        rule = cls(targets["nanovllm_num_requests_waiting"],
                   targets.get("nanovllm_num_requests_running"), spec["minReplicas"],
                   spec["maxReplicas"], up["value"], up["periodSeconds"],
                   spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"],
                   down["value"], down["periodSeconds"])
        return dataclasses.replace(rule, **overrides)


def simulate_hpa(trace: list[float], step_s: float, curve: LatencyCurve, rule: HPARule
                 ) -> dict[str, list[float]]:
    """One day under ``rule`` (module docstring), every ``rule.sync_s``: for each moment the
    arrival rate, ready replicas, waiting requests, and an estimated TTFT p90 (the curve's at
    each replica's rate while nothing waits; past saturation, the saturated TTFT plus the
    time the queue takes to drain). The running metric is Little's law on the curve
    (``in_flight``), at most a saturated replica's."""
    dt = rule.sync_s
    ready, starting = rule.min_replicas, []  # starting: times pods become ready
    queue, wishes = 0.0, []  # wishes: (time, desired)
    added, removed = [], []  # (time, pods) changed within the rate policies' periods
    out = {"time_s": [], "rate": [], "replicas": [], "waiting": [], "ttft_p90": []}
    t, end = 0.0, len(trace) * step_s
    while t < end:
        rate = trace[min(int(t // step_s), len(trace) - 1)]
        ready += sum(1 for s in starting if s <= t)
        starting = [s for s in starting if s > t]
        queue = max(0.0, queue + (rate - ready * curve.saturation_rps) * dt)
        if queue > 0:
            ttft = curve.at(curve.rates[-1])[0] + queue / (ready * curve.saturation_rps)
        else:
            ttft = curve.at(rate / ready)[0]
        for key, value in zip(out, (t, rate, ready, queue, ttft)):
            out[key].append(value)
        # the controller: desired = ceil(current * metric / target) for each metric, the
        # largest wins; then its behavior
        current = ready + len(starting)
        desired = math.ceil(current * (queue / ready) / rule.target_waiting)
        if rule.target_running is not None:
            running = curve.in_flight(min(rate / ready, curve.saturation_rps))
            desired = max(desired, math.ceil(current * running / rule.target_running))
        desired = min(rule.max_replicas, max(rule.min_replicas, desired))
        wishes = [(w, d) for w, d in wishes if w > t - rule.scale_down_window_s] + [(t, desired)]
        desired = max(d for _, d in wishes) if desired < current else desired
        added = [(a, n) for a, n in added if a > t - rule.scale_up_period_s]
        removed = [(r, n) for r, n in removed if r > t - rule.scale_down_period_s]
        room = rule.scale_up_pods - sum(n for _, n in added)
        if desired > current and room > 0:
            pods = min(desired - current, room)
            starting += [t + rule.startup_s] * pods
            added.append((t, pods))
        elif desired < current:  # pods still starting go first (as a ReplicaSet does)
            surplus = min(current - desired, rule.scale_down_pods - sum(n for _, n in removed))
            cancelled = min(max(surplus, 0), len(starting))
            starting = starting[:len(starting) - cancelled]
            ready -= max(surplus, 0) - cancelled
            removed.append((t, max(surplus, 0)))
        t += dt
    return out
