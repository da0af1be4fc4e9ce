"""Prometheus metrics, named like vLLM's so existing dashboards read them
(`verispec:spec_decode_num_drafts` <-> `vllm:spec_decode_num_drafts`, and so on).

Speculation counters are added when a request ends (finished, stopped or aborted), from that
request's own statistics, so they always equal the sum over the requests that were served.
Generation tokens count what the client received: tokens generated past a stop string are not.
Error answers (4xx, 5xx, and errors inside a stream) are counted by status and reason."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series: they double the output and no dashboard reads them

P = "verispec:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        lbl = {"model_name": model_name}
        self._lbl = lbl
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Verification steps that checked at least one draft token", ["model_name"], registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens verified", ["model_name"], registry=r)
        self.num_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", ["model_name"], registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position", ["model_name", "position"], registry=r)
        self.target_forwards = Counter(P + "spec_decode_num_target_forwards", "Target forwards after prefill (tau = generation tokens / this)", ["model_name"], registry=r)
        self.drafter_errors = Counter(P + "spec_decode_drafter_errors", "Drafter failures (the request fell back to plain decoding)", ["model_name"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed", ["model_name"], registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", ["model_name"], registry=r)
        self.requests = Counter(P + "request_success", "Finished requests by reason", ["model_name", "finished_reason"], registry=r)
        self.errors = Counter(P + "request_errors", "Error answers by HTTP status and reason (the error code)",
                              ["model_name", "status", "reason"], registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests in the running batch", ["model_name"], registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for a KV slot", ["model_name"], registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "Fraction of KV slots in use", ["model_name"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**lbl)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Time per output token after the first", ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**lbl)
        self._drafter_errors_seen = 0
        # adaptive verification (adaptive/): what the policy chose and how well it predicts
        self.adaptive_budget = Histogram(P + "spec_decode_adaptive_budget_tokens", "Draft tokens admitted for verification per decode step (adaptive policy)",
                                         ["model_name"], buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r).labels(**lbl)
        self.adaptive_window = Gauge(P + "spec_decode_adaptive_window", "Verify window of the last step: draft tokens per request at most", ["model_name"], registry=r)
        self.adaptive_coef = Gauge(P + "spec_decode_adaptive_estimator_coefficient", "Acceptance estimator: shared slope(s) and per-depth intercepts",
                                   ["model_name", "kind", "index"], registry=r)
        self.adaptive_predicted = Counter(P + "spec_decode_adaptive_predicted_accepted", "Sum of predicted acceptance over observed draft positions", ["model_name"], registry=r)
        self.adaptive_observed = Counter(P + "spec_decode_adaptive_observed_accepted", "Accepted draft positions among the same observations", ["model_name"], registry=r)
        self.adaptive_observations = Counter(P + "spec_decode_adaptive_observations", "Draft positions observed by the estimator (verified, parent accepted)", ["model_name"], registry=r)
        self._adaptive_seen = (0, 0.0, 0.0, 0)  # policy steps, predicted, observed, observations

    def observe_engine(self, eng) -> None:
        self.running.labels(**self._lbl).set(eng.num_active)
        self.waiting.labels(**self._lbl).set(len(eng.waiting))
        self.kv_usage.labels(**self._lbl).set(1 - eng.cache.num_free / eng.cache.num_slots)
        self._observe_policy(eng.policy)
        new_errors = eng.drafter_errors - self._drafter_errors_seen
        if new_errors:
            self.drafter_errors.labels(**self._lbl).inc(new_errors)
            self._drafter_errors_seen = eng.drafter_errors

    def _observe_policy(self, policy) -> None:
        est = getattr(policy, "estimator", None)
        if est is None or policy.steps == self._adaptive_seen[0]:
            return  # not adaptive, or no step since the last look
        lbl = self._lbl
        self.adaptive_budget.observe(policy.last_admitted)
        self.adaptive_window.labels(**lbl).set(policy.width or 0)
        co = est.coefficients()
        for kind in ("slope", "intercepts"):
            for i, v in enumerate(co[kind]):
                self.adaptive_coef.labels(kind=kind, index=str(i), **lbl).set(v)
        _, pred, obs, n = self._adaptive_seen
        self.adaptive_predicted.labels(**lbl).inc(est.predicted_sum - pred)
        self.adaptive_observed.labels(**lbl).inc(est.observed_sum - obs)
        self.adaptive_observations.labels(**lbl).inc(est.observations - n)
        self._adaptive_seen = (policy.steps, est.predicted_sum, est.observed_sum, est.observations)

    def error(self, status: int, reason: str | None) -> None:
        self.errors.labels(status=str(status), reason=reason or "unknown", **self._lbl).inc()

    def request_finished(self, handle, reason: str) -> None:
        """Count one finished sequence (called once per handle, by worker.release)."""
        lbl = self._lbl
        self.requests.labels(finished_reason=reason, **lbl).inc()
        seq = handle.seq
        if seq is None:  # never reached the engine
            return
        st = seq.stats
        n_out = handle.num_returned
        if handle.choice == 0:  # the n choices of a prompt share it: counted once, as in usage
            self.prompt_tokens.labels(**lbl).inc(len(seq.prompt_ids))
        self.generation_tokens.labels(**lbl).inc(n_out)
        self.num_drafts.labels(**lbl).inc(st.drafts)
        self.num_draft_tokens.labels(**lbl).inc(st.drafted)
        self.num_accepted.labels(**lbl).inc(st.accepted)
        self.target_forwards.labels(**lbl).inc(st.forwards)
        for pos, n in enumerate(st.accepted_at):
            self.accepted_per_pos.labels(position=str(pos), **lbl).inc(n)
        if handle.first_token_at is not None and n_out > 1:
            self.tpot.observe((handle.finished_at - handle.first_token_at) / (n_out - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
