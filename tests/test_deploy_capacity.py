"""Capacity planning on the recorded H200 latency curve (nanovllm/deploy/capacity.py, chapter
17 §6): the curve's interpolation, the SLO's rate, the planner's replicas, the autoscaler
simulation, and hpa.yaml's running target against Little's law on the same record."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from nanovllm.deploy.capacity import (
    HPARule,
    LatencyCurve,
    day_trace,
    replicas_needed,
    simulate_hpa,
)
from nanovllm.deploy.manifests import k8s_objects

RECORD = Path(__file__).resolve().parents[1] / "figures/data/serve_h200.json"
SLO = (0.2, 0.025)  # TTFT p90, TPOT p90 (seconds): the chapter's


@pytest.fixture(scope="module")
def curve() -> LatencyCurve:
    return LatencyCurve.from_record(RECORD)


def test_curve_passes_through_the_measured_points(curve):
    assert curve.rates == sorted(curve.rates) and len(curve.rates) >= 2
    for rate, ttft, tpot in zip(curve.rates, curve.ttft_p90, curve.tpot_p90):
        assert curve.at(rate) == pytest.approx((ttft, tpot))
    mid = (curve.rates[0] + curve.rates[1]) / 2
    assert curve.at(mid)[0] == pytest.approx((curve.ttft_p90[0] + curve.ttft_p90[1]) / 2)
    assert curve.saturation_rps > 0


def test_max_rate_is_the_edge_of_the_slo(curve):
    rate = curve.max_rate(*SLO)
    assert 0 < rate <= curve.saturation_rps
    ttft, tpot = curve.at(rate)
    assert ttft <= SLO[0] and tpot <= SLO[1]
    over = curve.at(rate + 0.05)
    assert over[0] > SLO[0] or over[1] > SLO[1]
    assert curve.max_rate(1e-6, 1e-6) == 0.0  # an SLO nothing meets
    assert curve.max_rate(100, 100) == curve.saturation_rps


def test_planner_gives_each_replica_at_most_its_rate():
    trace = day_trace(peak_rps=400, trough_rps=40, step_s=300, seed=1)
    assert len(trace) == 288 and min(trace) > 30 and max(trace) < 450
    assert trace.index(max(trace)) * 300 / 3600 == pytest.approx(16, abs=1.5)
    need = replicas_needed(trace, 44.0)
    for rate, n in zip(trace, need):
        assert rate / n <= 44.0 and (n == 1 or rate / (n - 1) > 44.0)


def test_hpa_simulation_follows_the_manifest(curve):
    rule = HPARule.from_manifest(k8s_objects()["HorizontalPodAutoscaler"], max_replicas=16)
    assert (rule.target_waiting, rule.min_replicas, rule.scale_down_window_s) == (8, 2, 300)
    trace = day_trace(peak_rps=400, trough_rps=40)
    both = simulate_hpa(trace, 60, curve, rule)
    queue_only = simulate_hpa(trace, 60, curve, dataclasses.replace(rule, target_running=None))
    for run in (both, queue_only):
        assert len(run["time_s"]) == 86400 / rule.sync_s
        assert rule.min_replicas <= min(run["replicas"]) <= max(run["replicas"]) <= 16
        assert min(run["waiting"]) >= 0
    missed = lambda run: sum(t > SLO[0] for t in run["ttft_p90"]) / len(run["ttft_p90"])
    # the running metric keeps the fleet from collapsing whenever the queue empties
    assert missed(both) < missed(queue_only) / 2
    assert max(both["waiting"]) < max(queue_only["waiting"])


def test_manifest_running_target_fits_the_slo_rate(curve):
    hpa = k8s_objects()["HorizontalPodAutoscaler"]
    rule = HPARule.from_manifest(hpa)
    in_flight = curve.in_flight(curve.max_rate(*SLO))
    assert rule.target_running <= in_flight < 1.25 * rule.target_running
    assert math.isclose(curve.in_flight(0), 0)


def test_hpa_scale_down_follows_the_rate_policy(curve):
    """A fall from peak to nothing: after the stabilization window, at most
    ``scale_down_pods`` pods go per ``scale_down_period_s`` (hpa.yaml: 1 per 120 s)."""
    rule = HPARule.from_manifest(k8s_objects()["HorizontalPodAutoscaler"], max_replicas=16)
    assert (rule.scale_down_pods, rule.scale_down_period_s) == (1, 120)
    run = simulate_hpa([400.0] * 30 + [0.0] * 60, 60, curve, rule)
    replicas, times = run["replicas"], run["time_s"]
    peak = max(replicas)
    assert peak > rule.min_replicas + 2 and replicas[-1] == rule.min_replicas
    for i, now in enumerate(times):  # any 120 s span loses at most one pod
        later = [r for r, t in zip(replicas[i:], times[i:]) if t < now + rule.scale_down_period_s]
        assert replicas[i] - min(later) <= rule.scale_down_pods
    unlimited = dataclasses.replace(rule, scale_down_pods=peak)
    fast = simulate_hpa([400.0] * 30 + [0.0] * 60, 60, curve, unlimited)["replicas"]
    assert sum(fast) < sum(replicas)  # the policy is what slows the fall
