"""Cache-aware routing (nanovllm/deploy/router.py, chapter 17 §5): the router's block keys are
the engine's prefix-cache keys; its choice (assignment 17.route) against an independent
reference on random states, and graded on a replayed multi-tenant trace by hit rate and
balance; and a two-replica fleet of tiny engines where it beats round-robin."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from course_ids import ENGINE
from test_scheduler import make_llm, make_tiny_llama

from nanovllm.benchmarks.fleet import run_fleet, tenant_workload
from nanovllm.deploy.router import PrefixAwareRouter, RoundRobinRouter, block_hashes
from nanovllm.engine.block_manager import chain_hash

ROUTE = "17.route"


def reference_choice(held, loads, slack, hashes) -> int:
    """The handout's rule, written independently: longest leading match among replicas
    within ``slack`` of the least load, then the least load, then the lowest index."""
    def match(r: int) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in held[r]:
            n += 1
        return n

    eligible = [r for r in range(len(loads)) if loads[r] <= min(loads) + slack]
    return min(eligible, key=lambda r: (-match(r), loads[r], r))


def router_with(held: list[set[int]], loads: list[int], slack: int) -> PrefixAwareRouter:
    router = PrefixAwareRouter(len(loads), block_size=4, capacity_blocks=1000, slack=slack)
    router.held = [OrderedDict.fromkeys(h) for h in held]
    router.loads = list(loads)
    return router


def test_block_hashes_are_the_engine_prefix_cache_keys():
    tokens = list(range(100, 150))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 3  # full blocks only (50 tokens)
    assert hashes[1] == chain_hash(chain_hash(None, tokens[:16]), tokens[16:32])
    assert block_hashes(tokens, 16, max_blocks=2) == hashes[:2]
    assert block_hashes(tokens[:15], 16) == []


@pytest.mark.assignment(ROUTE)
def test_choice_matches_the_reference_on_random_states():
    rng = random.Random(17)
    universe = list(range(40))
    for _ in range(400):
        n = rng.randint(1, 5)
        hashes = rng.sample(universe, rng.randint(0, 6))
        held = []
        for _ in range(n):  # some replicas hold a leading run of the request's hashes
            run = hashes[:rng.randint(0, len(hashes))]
            held.append(set(run) | set(rng.sample(universe, rng.randint(0, 10))))
        loads = [rng.randint(0, 6) for _ in range(n)]
        slack = rng.randint(0, 3)
        router = router_with(held, loads, slack)
        before = ([dict(h) for h in router.held], list(router.loads))
        assert router.choose(hashes) == reference_choice(held, loads, slack, hashes)
        assert ([dict(h) for h in router.held], router.loads) == before  # nothing changed


@pytest.mark.assignment(ROUTE)
def test_choice_counts_only_a_leading_run_and_respects_slack():
    a, b, c = 11, 22, 33
    # replica 1 holds the later blocks but not the first: a different prefix, no match
    assert router_with([{a}, {b, c}], [0, 0], slack=9).choose([a, b, c]) == 0
    # the longest match wins over lower load, within the slack ...
    assert router_with([{a}, {a, b, c}], [0, 2], slack=2).choose([a, b, c]) == 1
    # ... but not beyond it
    assert router_with([{a}, {a, b, c}], [0, 3], slack=2).choose([a, b, c]) == 0
    # equal matches: the least loaded; equal loads too: the lowest index
    assert router_with([{a}, {a}, {a}], [2, 1, 1], slack=5).choose([a, b]) == 1
    # no blocks at all (a short prompt): the least loaded
    assert router_with([{a}, set()], [3, 1], slack=5).choose([]) == 1


def replay(router, prompts: list[list[int]], block_size: int, in_flight: int = 6):
    """Route ``prompts`` in order, each finishing after ``in_flight`` later arrivals; with an
    unbounded cache per replica, count leading blocks already sent there (hits)."""
    cached = [set() for _ in range(router.num_replicas)]
    sent, hits, total, counts = [], 0, 0, [0] * router.num_replicas
    for prompt in prompts:
        if len(sent) >= in_flight:
            router.finished(sent.pop(0))
        replica = router.route(prompt)
        sent.append(replica)
        counts[replica] += 1
        hashes = block_hashes(prompt, block_size)
        for h in hashes:
            if h not in cached[replica]:
                break
            hits += 1
        total += len(hashes)
        cached[replica].update(hashes)
    return hits / total, counts


@pytest.mark.assignment(ROUTE)
def test_replayed_trace_hit_rate_and_balance():
    work = tenant_workload(tenants=8, per_tenant=12, length_scale=1 / 16, seed=3)
    for replicas in (2, 4):
        smart = PrefixAwareRouter(replicas, block_size=16, capacity_blocks=10_000)
        hit, counts = replay(smart, work.prompts, 16)
        rr_hit, _ = replay(RoundRobinRouter(replicas), work.prompts, 16)
        assert hit > rr_hit + 0.02 * replicas, (hit, rr_hit)
        # balanced: no replica gets more than twice its share or is left idle
        assert max(counts) <= 2 * len(work.prompts) / replicas and min(counts) > 0, counts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-fleet")))


@pytest.mark.assignment(ROUTE, *ENGINE)
def test_fleet_of_two_tiny_replicas(tiny):
    """Two engines whose caches cannot keep every tenant's prefix: round-robin thrashes
    them, the prefix-aware router keeps each tenant on one replica."""
    work = tenant_workload(tenants=4, per_tenant=3, length_scale=1 / 32, request_rate=50.0)
    llms = [make_llm(tiny, num_kv_blocks=14, block_size=16, dtype="float32",
                     max_num_seqs=4) for _ in range(2)]
    engines = [llm.engine for llm in llms]
    results, smart_router = {}, PrefixAwareRouter(2, 16, 14, slack=2)
    for router in (RoundRobinRouter(2), smart_router):
        for engine in engines:
            assert engine.reset_prefix_cache()
        results[router.name] = run_fleet(engines, router, work)
    rr, smart = results["round-robin"], results["prefix-aware"]
    for result in (rr, smart):
        assert len(result.ttft) == len(work.prompts) and min(result.ttft) >= 0
        assert sum(result.requests_per_replica) == len(work.prompts)
        assert result.output_tokens == work.output_tokens and result.seconds > 0
    assert smart.hit_rate > rr.hit_rate + 0.1, (smart.summary(), rr.summary())
    # what the router believes each replica holds is, in good part, what its cache holds
    for replica, engine in enumerate(engines):
        registered = set(engine.block_manager.hash_to_block)
        believed = set(smart_router.held[replica])
        assert len(believed & registered) >= len(believed) // 2, replica
    for llm in llms:
        llm.shutdown()
