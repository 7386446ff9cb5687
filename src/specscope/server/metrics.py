"""Prometheus metrics of `specscope serve`.

The speculative counters mirror vLLM's names with a `specscope:` prefix instead of `vllm:` (`--metrics-prefix
vllm` gives vLLM's exact names; `bench-serve` reads either): num_drafts (verify cycles), num_draft_tokens,
num_accepted_tokens and accepted tokens per draft position. specscope adds the wall time of each engine step and
its split (cycle_phase_seconds{phase="step"}: one batched forward and everything around it; phase draft, verify,
accept, commit, other: the parts, which add up to it) and, with a drafter, how many steps drafted and how many ran
plain (spec_decode_steps{mode=...}: the --spec-policy's choices) and, under the priced policy, why
(spec_policy_decisions{decision, reason}); and, with a drafter, what it drafts with as an info metric
(spec_decode_info{draft, spec_policy, draft_budget, steps, topk, draft_tokens, ngram_tokens} 1), which `bench-serve`
stores so that a served run names its drafter.
Each server owns its registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class DraftingInfo:
    """What a server drafts with: the labels of its spec_decode_info metric. draft is --draft as given; the knobs
    are the shape it drafts in (the flags, else the drafter's declared shape)."""
    draft: str
    spec_policy: str
    draft_budget: str
    steps: int
    topk: int
    draft_tokens: int
    ngram_tokens: int = 0

    @classmethod
    def of(cls, cfg, shape) -> "DraftingInfo | None":
        """From a ServeConfig and the SpecConfig it drafts in; None without a drafter."""
        if shape is None:
            return None
        return cls(cfg.drafting.draft, cfg.spec_policy, cfg.drafting.budget, shape.steps, shape.topk,
                   shape.draft_tokens, shape.ngram_tokens)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, prefix: str = "specscope", drafting: DraftingInfo | None = None):
        # prefix "vllm" makes the names identical to vLLM's, for dashboards built on those
        P = prefix + ":"
        r = self.registry = CollectorRegistry()
        if drafting is not None:
            # an info metric (a gauge fixed at 1, as vLLM's cache_config_info): scrapers read the labels
            labels = {k: str(v) for k, v in asdict(drafting).items()}
            Gauge(P + "spec_decode_info", "What the server drafts with: the drafter (--draft), --spec-policy, "
                  "--draft-budget and the draft shape.", list(labels), registry=r).labels(**labels).set(1)
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Verify cycles (drafts proposed).", registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position.", ["position"], registry=r)
        self.phase_seconds = Histogram(P + "cycle_phase_seconds", "Time per engine step ('step') and per phase of "
                                       "it (draft, verify, accept, commit, other).", ["phase"],
                                       buckets=PHASE_BUCKETS, registry=r)
        self.spec_steps = Counter(P + "spec_decode_steps", "Engine steps with decoding sequences, by whether they "
                                  "drafted (mode=draft) or ran plain (mode=plain).", ["mode"], registry=r)
        self.policy_decisions = Counter(P + "spec_policy_decisions", "The priced --spec-policy's choice per engine "
                                        "step (decision=draft|plain) and why (reason=predicted_faster, probe, "
                                        "no_costs_yet, predicted_slower).", ["decision", "reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", registry=r)
        # vLLM's prefix-cache counters, in tokens: hits / queries is the share of prompt tokens not computed
        self.prefix_cache_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                            registry=r)
        self.prefix_cache_hits = Counter(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache (reused).",
                                         registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.request_failed = Counter(P + "request_failed", "Requests that ended in an error or were cancelled.",
                                      ["reason"], registry=r)
        self.requests_rejected = Counter(P + "requests_rejected", "Requests refused with 429 (queue full).",
                                         registry=r)
        self.running = Gauge(P + "num_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting to join the batch.", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from enqueue to the first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from enqueue to the last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        # vLLM's split of e2e: waiting for a place in the batch (enqueued -> first scheduled) vs being decoded
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time a request waited to join the batch.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram(P + "request_inference_time_seconds",
                                        "Time a request spent in the batch (prefill + decode).",
                                        buckets=LATENCY_BUCKETS, registry=r)

    def observe_spec(self, stats) -> None:
        """Count one finished speculative request from its GenerationResult.stats (a SpecStats)."""
        self.num_drafts.inc(stats.cycles)
        self.num_draft_tokens.inc(sum(stats.drafts_per_pos))
        self.num_accepted_tokens.inc(sum(stats.accepted_per_pos))
        for i, n in enumerate(stats.accepted_per_pos):
            self.accepted_per_pos.labels(position=str(i)).inc(int(n))

    def observe_phases(self, cycle_ms: dict) -> None:
        for phase, values in cycle_ms.items():
            h = self.phase_seconds.labels(phase=phase)
            for v in values:
                h.observe(float(v) / 1e3)

    def observe_step(self, rec, decision: tuple[str, str] | None = None) -> None:
        """Count one engine step (engine/batch.py StepRecord) of a server with a drafter by what it did, and the
        priced policy's `decision` for it ((draft | plain, reason); None for the other policies)."""
        if rec.batch:
            self.spec_steps.labels(mode="draft" if rec.drafted else "plain").inc()
            if decision is not None:
                self.policy_decisions.labels(decision=decision[0], reason=decision[1]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
