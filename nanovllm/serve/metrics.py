"""``/metrics``: the server's Prometheus metrics, vLLM's names under ``nanovllm:`` (chapter 10).

Gauges are read from the engine when Prometheus scrapes (running and waiting sequences,
KV-cache usage, prefix-cache hit rate: ``engine.load()``, which an engine core in another
process reports with every step), and so are the engine's step times since the last scrape
(``engine_step_seconds``); histograms and counters are updated when a request
ends (time to first token, time per output token, end-to-end latency, queue time; prompt
and generated tokens; finished requests by reason, "abort" when the client left) or is
turned away (rejections by reason: every error answer, 400s included, by its code).
Speculative decoding's counters (requests' steps with proposals, proposed and accepted
tokens, accepted tokens by position) follow the engine's step totals
(``EngineStats``), read when Prometheus scrapes. Each server has its own registry, so several
can live in one process (tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanovllm.outputs import RequestOutput

if TYPE_CHECKING:
    from nanovllm.engine.core_client import EngineCoreClient
    from nanovllm.engine.llm_engine import LLMEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets (seconds), from a GPU's milliseconds to a loaded CPU's seconds
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    def __init__(self, engine: LLMEngine | EngineCoreClient, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        self.engine_stats, self._steps_seen = engine.stats, engine.stats.num_steps
        self._spec_seen = _spec_totals(engine.stats)
        label = ["model_name"]

        def gauge(name: str, doc: str, read) -> None:
            g = Gauge(f"nanovllm:{name}", doc, label, registry=registry)
            g.labels(model_name).set_function(read)

        load = engine.load
        gauge("num_requests_running", "Sequences in the running batch.",
              lambda: load().num_running)
        gauge("num_requests_waiting", "Sequences waiting for a slot.",
              lambda: load().num_waiting)
        gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
              lambda: load().kv_usage)
        gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache (0-1).",
              lambda: load().prefix_hit_rate)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"nanovllm:{name}", doc, label, buckets=buckets, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time between tokens.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                               E2E_BUCKETS)
        self.step = histogram("engine_step_seconds", "Wall time of one engine step, in the "
                              "engine core.", STEP_BUCKETS)
        self.prompt_tokens = Counter("nanovllm:prompt_tokens", "Prompt tokens processed.",
                                     label, registry=registry)
        self.generation_tokens = Counter("nanovllm:generation_tokens", "Tokens generated.",
                                         label, registry=registry)
        self.finished = Counter("nanovllm:request_success", "Requests ended, by finish reason.",
                                [*label, "finished_reason"], registry=registry)
        self.rejected = Counter("nanovllm:request_rejected", "Requests turned away, by reason.",
                                [*label, "reason"], registry=registry)
        spec = lambda name, doc, labels=(): Counter(  # noqa: E731
            f"nanovllm:spec_decode_{name}", doc, [*label, *labels], registry=registry)
        self.spec_drafts = spec("num_drafts", "Speculative decoding: (request, step) pairs "
                                "with proposals.")
        self.spec_draft_tokens = spec("num_draft_tokens", "Speculative decoding: tokens "
                                      "proposed.")
        self.spec_accepted_tokens = spec("num_accepted_tokens", "Speculative decoding: "
                                         "proposed tokens accepted.")
        self.spec_accepted_per_pos = spec("num_accepted_tokens_per_pos", "Speculative "
                                          "decoding: accepted tokens by position in a request's "
                                          "proposals (0: the first).", ["position"])
        for metric in (self.ttft, self.tpot, self.e2e, self.queue, self.step, self.prompt_tokens,
                       self.generation_tokens, self.spec_drafts, self.spec_draft_tokens,
                       self.spec_accepted_tokens):
            metric.labels(model_name)  # every series exists from the start, at zero

    def observe(self, output: RequestOutput) -> None:
        """A request has ended: record its latencies and tokens."""
        model = self.model_name
        m = output.metrics
        if m is not None:
            for hist, value in ((self.ttft, m.time_to_first_token),
                                (self.tpot, m.time_per_output_token),
                                (self.e2e, m.e2e_latency), (self.queue, m.queue_time)):
                if value is not None:
                    hist.labels(model).observe(value)
        self.prompt_tokens.labels(model).inc(len(output.prompt_token_ids))
        generated = sum(len(o.token_ids) for o in output.outputs)
        self.generation_tokens.labels(model).inc(generated)
        for completion in output.outputs:
            self.finished.labels(model, completion.finish_reason or "abort").inc()

    def aborted(self, sequences: int) -> None:
        """A request whose client left before its sequences finished (none was observed)."""
        self.finished.labels(self.model_name, "abort").inc(sequences)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        self._observe_steps()
        self._count_speculation()
        return generate_latest(self.registry)

    def _count_speculation(self) -> None:
        """Add what speculative decoding counted since the last scrape (nothing across an
        ``EngineStats.reset``: a counter never goes down)."""
        model, totals = self.model_name, _spec_totals(self.engine_stats)
        drafts, draft_tokens, accepted, per_pos = totals
        seen_drafts, seen_draft_tokens, seen_accepted, seen_per_pos = self._spec_seen
        self._spec_seen = totals
        self.spec_drafts.labels(model).inc(max(0, drafts - seen_drafts))
        self.spec_draft_tokens.labels(model).inc(max(0, draft_tokens - seen_draft_tokens))
        self.spec_accepted_tokens.labels(model).inc(max(0, accepted - seen_accepted))
        for j, count in enumerate(per_pos):
            before = seen_per_pos[j] if j < len(seen_per_pos) else 0
            self.spec_accepted_per_pos.labels(model, str(j)).inc(max(0, count - before))

    def _observe_steps(self) -> None:
        """The engine's steps since the last scrape (as many as its stats still hold)."""
        stats = self.engine_stats
        new = min(stats.num_steps - self._steps_seen, len(stats.steps))
        self._steps_seen = stats.num_steps
        if new > 0:
            hist = self.step.labels(self.model_name)
            for step in list(stats.steps)[-new:]:
                hist.observe(step.wall_time)


def _spec_totals(stats) -> tuple[int, int, int, tuple[int, ...]]:
    """Speculative decoding's totals in ``stats`` (an ``EngineStats``), as a snapshot."""
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            tuple(stats.num_accepted_tokens_per_pos))
