"""Engine counters and histograms, rendered as Prometheus text (exposition format 0.0.4).

No prometheus_client dependency: a few gauges, counters and two histograms are simple to write.
Metric names follow vLLM's (`vllm:` prefix replaced by `firstlight:`) so dashboards carry over.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.num += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cum = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            cum += c
            lines.append(f'{name}_bucket{{le="{b}"}} {cum}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.num}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.num}")
        return lines


class EngineMetrics:
    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)
        self.schedule_s = 0.0
        self.execute_s = 0.0
        self.sample_s = 0.0
        self.spec: Any = None  # SpecDecodeStats when the engine speculates

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens += num_prompt_tokens

    def on_token(self, state: Any, now_s: float) -> None:
        """Called when a request got new tokens this step; `state` is the engine's request state."""
        req = state.request
        new = req.num_output_tokens - state.num_sent_tokens
        self.num_generation_tokens += new
        if state.first_token_s is None:
            state.first_token_s = now_s
            self.ttft.observe(now_s - req.arrival_s)
        elif state.last_token_s is not None:
            self.itl.observe(now_s - state.last_token_s)
        state.last_token_s = now_s

    def on_finish(self, request: Any) -> None:
        reason = request.status.finish_reason
        if reason:
            self.num_requests_finished[reason] = self.num_requests_finished.get(reason, 0) + 1
        self.num_preemptions += request.num_preemptions

    def on_step(self, batch: Any, kv_usage: float, num_running: int, num_waiting: int) -> None:
        self.num_steps += 1
        self.kv_usage = kv_usage
        self.num_running = num_running
        self.num_waiting = num_waiting

    def record_step_times(self, schedule_s: float, execute_s: float, sample_s: float) -> None:
        self.schedule_s += schedule_s
        self.execute_s += execute_s
        self.sample_s += sample_s

    def _render_spec(self, model_name: str) -> list[str]:
        """vLLM's spec-decode counters: acceptance rate = accepted / draft tokens."""
        p, label, st = "firstlight:", f'{{model_name="{model_name}"}}', self.spec
        lines = []
        for name, value, help_text in (
            ("spec_decode_num_drafts", st.num_drafts, "Speculative steps (one per request verified)."),
            ("spec_decode_num_draft_tokens", st.num_draft_tokens, "Proposed tokens verified."),
            ("spec_decode_num_accepted_tokens", st.num_accepted_tokens, "Proposed tokens accepted."),
        ):
            lines += [f"# HELP {p}{name}_total {help_text}", f"# TYPE {p}{name}_total counter",
                      f"{p}{name}_total{label} {value}"]
        lines += [f"# HELP {p}spec_decode_num_accepted_tokens_per_pos_total Accepted tokens by proposal position.",
                  f"# TYPE {p}spec_decode_num_accepted_tokens_per_pos_total counter"]
        for pos, n in enumerate(st.accepted_per_pos):
            lines.append(f'{p}spec_decode_num_accepted_tokens_per_pos_total{{model_name="{model_name}",position="{pos}"}} {n}')
        return lines

    def render(self, model_name: str, kv_usage: float, num_running: int, num_waiting: int) -> str:
        label = f'{{model_name="{model_name}"}}'
        p = "firstlight:"
        lines = [
            f"# HELP {p}num_requests_running Requests in the running batch.",
            f"# TYPE {p}num_requests_running gauge",
            f"{p}num_requests_running{label} {num_running}",
            f"# HELP {p}num_requests_waiting Requests waiting (incl. preempted).",
            f"# TYPE {p}num_requests_waiting gauge",
            f"{p}num_requests_waiting{label} {num_waiting}",
            f"# HELP {p}kv_cache_usage_perc Fraction of KV blocks held by requests (0-1).",
            f"# TYPE {p}kv_cache_usage_perc gauge",
            f"{p}kv_cache_usage_perc{label} {kv_usage}",
            f"# HELP {p}prompt_tokens_total Prompt tokens received.",
            f"# TYPE {p}prompt_tokens_total counter",
            f"{p}prompt_tokens_total{label} {self.num_prompt_tokens}",
            f"# HELP {p}generation_tokens_total Tokens generated.",
            f"# TYPE {p}generation_tokens_total counter",
            f"{p}generation_tokens_total{label} {self.num_generation_tokens}",
            f"# HELP {p}num_preemptions_total Preemptions of finished requests.",
            f"# TYPE {p}num_preemptions_total counter",
            f"{p}num_preemptions_total{label} {self.num_preemptions}",
            f"# HELP {p}request_success_total Finished requests by reason.",
            f"# TYPE {p}request_success_total counter",
        ]
        for reason, n in sorted(self.num_requests_finished.items()):
            lines.append(f'{p}request_success_total{{model_name="{model_name}",finished_reason="{reason}"}} {n}')
        if self.spec is not None:
            lines += self._render_spec(model_name)
        lines += self.ttft.render(f"{p}time_to_first_token_seconds", "Time to first token.")
        lines += self.itl.render(f"{p}inter_token_latency_seconds", "Time between consecutive tokens.")
        return "\n".join(lines) + "\n"
