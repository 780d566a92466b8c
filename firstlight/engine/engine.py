"""The engine: one `step()` = schedule, execute, sample, update (then detokenize and report).

`LLMEngine` is synchronous and single-threaded; `AsyncLLM` (async_engine.py) drives it from a
background thread for the server. Requests come in as text or token ids; outputs go out as
`RequestOutput` deltas, one per request that produced tokens or finished in the step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from firstlight.core.trace import RequestRecord, StepRecord, append_request, append_step, write_header
from firstlight.engine.detokenizer import IncrementalDetokenizer
from firstlight.engine.kv_groups import SlidingWindowGroups, sliding_blocks_needed
from firstlight.engine.kv_manager import KVCacheManager
from firstlight.engine.metrics import EngineMetrics
from firstlight.engine.request import Request, RequestStatus, SamplingParams
from firstlight.engine.runner import ModelRunner
from firstlight.engine.sampler import Sampler, TokenLogprobs, prompt_logprobs
from firstlight.engine.scheduler import Scheduler, SchedulerConfig
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.state_slots import PREFIX_CACHING_OFF_REASON, HybridCacheManager
from firstlight.errors import FirstlightError

logger = logging.getLogger(__name__)


def _no_cpu_time() -> float:  # LLMEngine.step without a trace: no per-phase CPU seconds
    return 0.0


@dataclass
class EngineConfig:
    """Engine settings, checked on construction. `num_blocks=None` sizes the cache from
    `kv_cache_bytes`; `max_model_len=None` takes the model's max_position_embeddings."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    compile_decode: bool = False
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | bf16 | fp16 | int8 | fp8 (firstlight/quant/kv.py)
    # sliding-window layers keep only their window's blocks (free the rest; mixed models get a second
    # block pool for them, engine/kv_groups.py); False: every layer keeps every block, as before
    free_out_of_window: bool = True
    # attention on our kernel extension (CPU, fp32 KV): decode reads each row's keys in place in the pools
    # (firstlight::paged_decode_attention), prefill chunks run firstlight::attention on the gathered keys;
    # False: every layer gathers its keys and runs SDPA
    paged_attention: bool = True
    # an uncompiled decode step runs every layer of a dense decoder in one native call (engine/native_decode.py;
    # needs paged_attention's conditions, declines other families and formats); False: the modules, op by op
    native_decode: bool = True
    seed: int = 0
    trace_path: str | Path | None = None
    speculative: SpecConfig | None = None  # a proposer (ngram, draft, heads, mtp) and its k; None = off

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise FirstlightError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FirstlightError(f"EngineConfig.{name} must be >= 1 (or None), got {value}")
        if self.trace_path is not None:
            self.trace_path = Path(self.trace_path)

    def as_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


@dataclass
class RequestOutput:
    """What one request produced in a step (deltas) and so far (totals)."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    output_token_ids: list[int]
    delta_text: str
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # all so far
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0


@dataclass
class _RequestState:
    """Engine-side state the scheduler does not need: text, logprobs, timing."""

    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_sent_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        mcfg = model.config
        self.eos_token_ids = tuple(mcfg.eos_token_ids)
        max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if max_model_len > mcfg.max_position_embeddings:
            raise FirstlightError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{mcfg.max_position_embeddings}; lower it"
            )
        # hybrid models: one recurrent state slot per running request, next to the KV blocks
        num_slots = config.max_num_seqs if mcfg.state_layers else 0
        self.prefix_caching_off_reason: str | None = None
        # (speculative decoding is fine for them: a verify pass keeps the recurrent state after every
        # token and the runner puts back the one after the last accepted token, `keep_accepted_states`)
        if num_slots and config.enable_prefix_caching:
            self.prefix_caching_off_reason = PREFIX_CACHING_OFF_REASON
            logger.warning("%s (%s)", PREFIX_CACHING_OFF_REASON, mcfg.model_type)
        state_bytes = num_slots * ModelRunner.state_bytes_per_slot(model)
        num_blocks = config.num_blocks or max(
            1, (config.kv_cache_bytes - state_bytes)
            // ModelRunner.kv_bytes_per_block(model, config.block_size, config.kv_cache_dtype)
        )
        num_sliding_blocks = None
        window_layers = [i for i in mcfg.kv_layers if mcfg.window(i)]
        evict = config.free_out_of_window and bool(window_layers) and not num_slots
        if num_slots:
            self.kv: KVCacheManager | SlidingWindowGroups = HybridCacheManager(num_blocks, config.block_size, num_slots)
        elif evict and len(window_layers) < len(mcfg.kv_layers):
            num_blocks, num_sliding_blocks = self._split_blocks(model, config, window_layers)
            self.kv = SlidingWindowGroups(
                KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching),
                KVCacheManager(num_sliding_blocks, config.block_size, config.enable_prefix_caching,
                               sliding_window=mcfg.sliding_window),
            )
        else:
            window = mcfg.sliding_window if evict else None  # every attention layer slides
            self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, window)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            self.kv,
        )
        self.max_model_len = self.scheduler.max_model_len
        device = next(model.parameters()).device
        self.runner = ModelRunner(
            model, num_blocks, config.block_size, device, config.compile_decode,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len, num_state_slots=num_slots,
            kv_cache_dtype=config.kv_cache_dtype,
            num_sliding_blocks=num_sliding_blocks, paged_attention=config.paged_attention,
            native_decode=config.native_decode,
        )
        if num_slots:
            self.runner.state_slot_of = self.kv.slot_of.__getitem__  # type: ignore[attr-defined]
        self.sampler = Sampler(config.seed)
        self.spec = None
        if config.speculative is not None:
            from firstlight.engine.speculative.decoder import SpecDecoder

            self.spec = SpecDecoder(config.speculative, model, tokenizer, self.sampler)
            self.runner.keep_hidden = self.spec.needs_hidden
            self.runner.keep_all_hidden = self.spec.needs_all_hidden
        self.metrics = EngineMetrics()
        self._states: dict[str, _RequestState] = {}
        self._next_id = 0
        self._t0 = time.perf_counter()
        self._trace_file = None
        if config.trace_path is not None:
            self._trace_file = open(config.trace_path, "w")  # noqa: SIM115 - closed in close()
            meta = {"engine": "firstlight", "config": config.as_dict(), "model": type(model).__name__,
                    "num_blocks": num_blocks, "threads": torch.get_num_threads()}
            write_header(self._trace_file, meta)

    @staticmethod
    def _split_blocks(model: torch.nn.Module, config: EngineConfig, window_layers: list[int]) -> tuple[int, int]:
        """(full-group blocks, sliding-group blocks): the sliding group needs only what the running
        requests' windows (plus one step's tokens) can hold; the full group gets the rest of the bytes.
        With `num_blocks` given, the full group gets that many."""
        mcfg = model.config
        full_layers = [i for i in mcfg.kv_layers if i not in window_layers]
        bpb_full = ModelRunner.kv_bytes_per_block(model, config.block_size, config.kv_cache_dtype, full_layers)
        bpb_sliding = ModelRunner.kv_bytes_per_block(model, config.block_size, config.kv_cache_dtype, window_layers)
        spec = config.speculative.num_spec_tokens if config.speculative is not None else 0
        need = sliding_blocks_needed(mcfg.sliding_window, config.block_size, config.max_num_seqs,
                                     config.max_num_batched_tokens + spec)
        if config.num_blocks:
            return config.num_blocks, min(need, config.num_blocks)
        num_full = (config.kv_cache_bytes - need * bpb_sliding) // bpb_full
        if num_full < need:  # a small cache: no request can outgrow its window anyway
            num_full = need = max(1, config.kv_cache_bytes // (bpb_full + bpb_sliding))
        return num_full, need

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FirstlightError("a text prompt needs a tokenizer; pass token ids or load one")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def make_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        """Tokenize and validate; raises FirstlightError for a bad request. Touches no engine state."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        vocab = self.model.config.vocab_size
        if not ids:
            raise FirstlightError("the prompt is empty; give at least one token")
        if any(t < 0 or t >= vocab for t in ids):
            raise FirstlightError(f"prompt token ids must lie in [0, {vocab}); got an out-of-range id")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise FirstlightError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
                f"{self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        return Request(request_id, ids, params, self.eos_token_ids, arrival_s=time.perf_counter())

    def add_request(
        self, prompt: str | list[int] | Request, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        """Validate (unless given a Request from `make_request`) and queue a request."""
        req = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id)
        params = req.sampling_params
        self.scheduler.add_request(req)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                req.prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
        state = _RequestState(req, detok)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        self._states[req.request_id] = state
        self.metrics.on_arrival(req.num_prompt_tokens)
        return req

    def abort_request(self, request_ids: list[str] | str) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.abort_requests(ids)
        self._release_finished()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        # CPU seconds per phase, for the trace only: thread_time is a syscall (perf_counter is not): ~3 us on a quiet
        # 2-core machine, 0.17-0.37 ms with another job on the cores (the syscall lets the thread be switched out)
        cpu_time = time.thread_time if self._trace_file is not None else _no_cpu_time
        cpu_start = cpu_time()
        batch = self.scheduler.schedule()
        t_sched = time.perf_counter()
        if not batch.seqs:
            return self._release_finished()
        requests = self.scheduler.requests
        cpu_sched = cpu_time()
        exec_out = self.runner.execute(batch, requests)
        t_exec = time.perf_counter()
        cpu_exec = cpu_time()

        sampled: dict[str, list[int]] = {}
        new_lps: dict[str, TokenLogprobs] = {}
        if exec_out.sample_ids:
            reqs = [requests[rid] for rid in exec_out.sample_ids]
            tokens, lps = self.sampler.sample(exec_out.sample_logits, reqs)
            for rid, tok, lp in zip(exec_out.sample_ids, tokens, lps, strict=True):
                sampled[rid] = [tok]
                if lp is not None:
                    new_lps[rid] = lp
        if self.spec is not None:
            spec_tokens = self.spec.verify(exec_out, requests)
            # hybrid models: the recurrent state after the last accepted token, not the last proposal
            self.runner.keep_accepted_states({rid: len(toks) - 1 for rid, toks in spec_tokens.items()})
            sampled.update(spec_tokens)
        self._record_prompt_logprobs(batch, exec_out.prompt_logits)
        touched = self.scheduler.update(batch, sampled)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.max_model_len)
        t_sample = time.perf_counter()

        now = time.perf_counter()
        outputs = []
        for req in touched:
            state = self._states[req.request_id]
            if req.request_id in new_lps:
                state.logprobs.append(new_lps[req.request_id])
            self.metrics.on_token(state, now)
            if state.detok is not None and not req.is_finished:
                stop = state.detok.add_tokens(req.output_token_ids[state.num_sent_tokens :])
                if stop is not None:
                    req.stop_reason = stop
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            elif state.detok is not None:
                state.detok.add_tokens(req.output_token_ids[state.num_sent_tokens :])
            if not req.is_finished:
                outputs.append(self._make_output(state))
        outputs.extend(self._release_finished())
        t_end = time.perf_counter()
        self.metrics.on_step(batch, self.kv.usage, self.scheduler.num_running, self.scheduler.num_waiting)
        if self.spec is not None:
            self.metrics.spec = self.spec.stats
        if self._trace_file is not None:
            rec = StepRecord(
                batch=batch,
                start_s=t_start - self._t0,
                schedule_s=t_sched - t_start,
                execute_s=t_exec - t_sched,
                sample_s=(t_sample - t_exec) + (t_end - now),
                cpu_s={"schedule": cpu_sched - cpu_start, "execute": cpu_exec - cpu_sched,
                       "sample": cpu_time() - cpu_exec},
                stats={
                    "kv_usage": self.kv.usage,
                    "num_running": self.scheduler.num_running,
                    "num_waiting": self.scheduler.num_waiting,
                    "num_forwards": exec_out.num_forwards,
                    "context_lens": [s.context_len for s in batch.seqs],
                    **(self.spec.last_step if self.spec is not None else {}),
                },
            )
            append_step(self._trace_file, rec)
        self.metrics.record_step_times(t_sched - t_start, t_exec - t_sched, (t_sample - t_exec) + (t_end - now))
        return outputs

    def _record_prompt_logprobs(self, batch: Any, prompt_logits: dict[str, torch.Tensor]) -> None:
        for seq in batch.seqs:
            logits = prompt_logits.get(seq.request_id)
            if logits is None:
                continue
            state = self._states[seq.request_id]
            req = state.request
            # logits at position p predict prompt token p+1; stop at the prompt's end
            first = seq.num_computed_tokens + 1
            last = min(seq.context_len, req.num_prompt_tokens - 1) + 1
            if last <= first:
                continue
            targets = req.prompt_token_ids[first:last]
            lps = prompt_logprobs(logits[: len(targets)], targets, req.sampling_params.prompt_logprobs or 0)
            assert state.prompt_logprobs is not None
            state.prompt_logprobs.extend(lps)

    def _release_finished(self) -> list[RequestOutput]:
        outputs = []
        for req in self.scheduler.pop_finished():
            state = self._states.pop(req.request_id, None)
            self.sampler.free(req.request_id)
            if self.spec is not None:
                self.spec.free(req.request_id)
            if state is None:
                continue
            self.metrics.on_finish(req)
            if self._trace_file is not None:
                self._trace_request(state)
            outputs.append(self._make_output(state))
        return outputs

    def _trace_request(self, state: _RequestState) -> None:
        """One request line per finished request: the workload the simulator replays from this trace."""
        req, t0 = state.request, self._t0
        append_request(self._trace_file, RequestRecord(
            request_id=req.request_id,
            arrival_s=req.arrival_s - t0,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            first_token_s=None if state.first_token_s is None else state.first_token_s - t0,
            finish_s=time.perf_counter() - t0,
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
            finish_reason=req.status.finish_reason,
        ))

    def _make_output(self, state: _RequestState) -> RequestOutput:
        req = state.request
        new_ids = req.output_token_ids[state.num_sent_tokens :]
        new_lps = state.logprobs[state.num_sent_tokens :]
        state.num_sent_tokens = req.num_output_tokens
        finished = req.is_finished
        delta = state.detok.take_delta(finished) if state.detok is not None else ""
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            new_token_ids=new_ids,
            output_token_ids=list(req.output_token_ids),
            delta_text=delta,
            text=state.detok.output_text if state.detok is not None else "",
            finished=finished,
            finish_reason=req.status.finish_reason if finished else None,
            stop_reason=req.stop_reason,
            new_logprobs=new_lps,
            logprobs=list(state.logprobs),
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens,
        )

    def close(self) -> None:
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None
