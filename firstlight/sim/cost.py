"""Op cost model: the time of one engine step (a `firstlight.core.Batch`) on one replica.

Every op is priced by a roofline (Williams, Waterman & Patterson, CACM 2009):

    t_op = max(flops / (peak_flops * eff_compute), bytes / (mem_bw * eff_memory)) + kernels * overhead

per device, with the replica's tensor-parallel shard of weights and heads. Attention is priced by
what a fused FlashAttention kernel moves (Dao 2022/2023): Q and O once, the KV of the span once per
query tile of `flash_tile` rows, the new K/V written once; FLOPs 2*H*(d_qk + d_v) per (query, key)
pair. MoE layers read the experts that receive at least one token and compute the most-loaded
EP rank's share (balls-into-bins imbalance). TP adds two all-reduces per layer on the scale-up link;
PP adds a point-to-point send per stage boundary. Each step adds the spec's step overhead (host
scheduling, launch) and a per-sequence overhead (sampling, detokenize, output processing).

`runner` says how the engine turns one Batch into forwards: `fused` (vLLM, TensorRT-LLM, SGLang: one
forward over the flattened tokens of every sequence) or `grouped` (firstlight's own runner: one
forward per distinct chunk length, `ModelRunner.execute` in engine/runner.py), where every forward
reads the weights and launches its kernels again.

A spec whose `efficiency.overlap` is `additive` (a CPU: its GEMMs pack and stream the weights, then
run the FMAs, and do not overlap the two) prices an op by the sum of the two times instead of their
max; its `efficiency.gemv_memory` prices the weight stream of a one-row linear (a matrix-vector
kernel) apart from the packed GEMM's. Every op goes through `roofline`, so `time`, `step_time`, the
serving simulator and calibration all price a step the same way.

`CostModel.time(batch)` prices the Batch the engine scheduler emits; `step_time(...)` prices the same
work from aggregates (what the serving simulator tracks) and is what `time()` calls, so both agree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from firstlight.core.batch import Batch
from firstlight.core.hardware import DTYPE_BYTES, EfficiencySpec, HardwareSpec
from firstlight.errors import FirstlightError
from firstlight.sim.cluster import ClusterConfig
from firstlight.sim.cluster import collective_time as cluster_collective_time
from firstlight.sim.collectives import collective_time
from firstlight.sim.model import LayerGroup, Linear, ModelDesc
from firstlight.sim.parallel import ParallelConfig, check_parallel, kv_shard
from firstlight.sim.system import TPLink, tp_link


@dataclass(frozen=True)
class OpCost:
    name: str
    flops: float  # per device, all layers of this op together
    bytes: float
    time_s: float
    bound: str  # compute | memory | network | overhead
    gemv: bool = False  # a one-row linear, priced at `efficiency.gemv_memory`

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


RUNNERS = ("fused", "grouped")


class CostModelError(FirstlightError):
    """A cost-model option the model does not know."""


class CostModel:
    def __init__(self, model: ModelDesc, hw: HardwareSpec, parallel: ParallelConfig | None = None,
                 compute_dtype: str | None = None, efficiency: EfficiencySpec | None = None,
                 flash_tile: int = 128, moe_imbalance: float | None = None,
                 collective_algorithm: str = "auto", runner: str = "fused", cluster: ClusterConfig | None = None,
                 host_kv_fraction: float = 0.0, host_kv_gbps: float = 64.0) -> None:
        if not 0 <= host_kv_fraction < 1:
            raise CostModelError(f"host KV fraction must be in [0, 1), got {host_kv_fraction}")
        self.host_kv_fraction = host_kv_fraction  # of the KV read from host memory (KV offload)
        self.host_kv_bw = host_kv_gbps * 1e9  # host <-> device link, bytes/s (PCIe 5 x16: ~64 GB/s)
        self.cluster = cluster  # given: TP / EP collectives are routed over its graph
        if runner not in RUNNERS:
            raise CostModelError(f"--runner {runner!r}: expected one of {RUNNERS}")
        self.runner = runner
        self.model = model
        self.hw = hw
        self.par = parallel or ParallelConfig()
        check_parallel(model, self.par)
        self.eff = efficiency or hw.efficiency
        # per-group dtypes from the model's precision profile (uniform when the model has one dtype)
        self.precision = model.profile
        prec = self.precision
        self.compute_dtype = compute_dtype or prec.math_dtype("mlp")
        self.flops_by_group = {g: hw.flops_per_s(compute_dtype or prec.math_dtype(g)) * self.eff.compute
                               for g in ("attention", "mlp", "lm_head", "sdpa")}
        self.flops_s = self.flops_by_group["mlp"]
        self.mem_bw = hw.memory.bandwidth_bytes_per_s * self.eff.memory
        gemv = self.eff.gemv_memory if self.eff.gemv_memory is not None else self.eff.memory
        self.gemv_bw = hw.memory.bandwidth_bytes_per_s * gemv
        self.additive = self.eff.overlap == "additive"
        self.kernel_s = self.eff.kernel_overhead_us * 1e-6
        self.step_s = self.eff.step_overhead_us * 1e-6
        self.seq_s = self.eff.seq_overhead_us * 1e-6
        self.wb_by_group = {g: DTYPE_BYTES[prec.weights(g)] for g in ("attention", "mlp", "experts", "lm_head")}
        self.wb = self.wb_by_group["mlp"]
        self.ab = DTYPE_BYTES[prec.activations]
        self.kvb = DTYPE_BYTES[prec.kv_cache]
        self.flash_tile = flash_tile
        self.moe_imbalance = moe_imbalance
        self.collective_algorithm = collective_algorithm
        self.kv_shard = kv_shard(model, self.par)
        self._system_links: dict[int, TPLink | None] = {}
        self._token_cache = lru_cache(maxsize=65536)(self._token_ops_time)
        self._logits_cache = lru_cache(maxsize=4096)(self._logits_time)

    # ---- primitives ---------------------------------------------------------------------------
    def roofline(self, name: str, flops: float, nbytes: float, kernels: float = 1.0,
                 flops_s: float | None = None, scale: float = 1.0, gemv: bool = False) -> OpCost:
        """`flops_s`: the math rate of the op's precision group (default: the MLP's); `scale` divides the
        achieved rates (attention kernels' own efficiency, `EfficiencySpec.attention`); `gemv`: a
        one-row product, its bytes move at the spec's matrix-vector rate."""
        tc = flops / ((flops_s or self.flops_s) * scale)
        tm = nbytes / ((self.gemv_bw if gemv else self.mem_bw) * scale)
        over = kernels * self.kernel_s
        bound = "compute" if tc >= tm else "memory"
        t = self.combine(tc, tm)
        if over > t:
            bound = "overhead"
        return OpCost(name, flops, nbytes, t + over, bound, gemv)

    def combine(self, t_compute: float, t_memory: float) -> float:
        """An op's time from its compute and memory times: max (overlapped) or their sum (`overlap`)."""
        return t_compute + t_memory if self.additive else max(t_compute, t_memory)

    def _linear(self, lin: Linear, m: float, shard: int, layers: int, group: str = "mlp") -> OpCost:
        """`group`: attention | mlp | lm_head; picks the weight dtype and the math rate of the profile."""
        flops = 2.0 * m * lin.num_params / shard
        wb = self.wb_by_group[group]
        nbytes = lin.num_params * wb / shard + m * (lin.in_features + lin.out_features / shard) * self.ab
        c = self.roofline(lin.name, flops, nbytes, flops_s=self.flops_by_group[group], gemv=m == 1)
        return OpCost(lin.name, flops * layers, nbytes * layers, c.time_s * layers, c.bound, c.gemv)

    def _comm_link(self, group: int | None = None) -> tuple[float, float]:
        """(alpha, bandwidth) a collective over `group` ranks (default: the TP group) sees.

        With a `system` section in the spec the ring is routed over the box's own links (sim/system.py),
        so a group that spans a slow inter-card link is priced on it; otherwise: scale-up if the group
        fits in one domain, else scale-out.
        """
        group = self.par.tp if group is None else group
        if group not in self._system_links:
            self._system_links[group] = tp_link(self.hw, group)
        sys_link = self._system_links[group]
        overhead = self.eff.collective_overhead_us * 1e-6
        if sys_link is not None:
            return sys_link.alpha_s + overhead, sys_link.bandwidth * self.eff.network
        links = self.hw.links
        link = links.scale_up if links.scale_up and group <= links.scale_up.domain_size else links.scale_out
        if link is None:
            return 0.0, float("inf")
        return link.latency_s + overhead, link.bandwidth_bytes_per_s * self.eff.network

    def _allreduce(self, name: str, nbytes: float, count: int) -> OpCost:
        if self.par.tp == 1 or nbytes <= 0:
            return OpCost(name, 0.0, 0.0, 0.0, "network")
        if self.cluster is not None:
            alg = "ring" if self.collective_algorithm in ("auto", "nccl") else self.collective_algorithm
            t = cluster_collective_time(self.cluster, self.hw, "all_reduce", nbytes, list(range(self.par.tp)), alg)
        else:
            alpha, bw = self._comm_link()
            t = collective_time("all_reduce", nbytes, self.par.tp, alpha, bw, self.collective_algorithm)
        return OpCost(name, 0.0, nbytes * count, t * count, "network")

    # ---- token-count-dependent ops (cached by m) ----------------------------------------------
    def _group_token_ops(self, g: LayerGroup, m: int) -> list[OpCost]:
        tp, L, h = self.par.tp, g.num_layers, self.model.hidden_size
        ops = [self._linear(lin, m, tp, L, "attention") for lin in g.attn_linears]
        if g.moe is None:
            ops += [self._linear(lin, m, tp, L) for lin in g.mlp_linears]
            inter = g.mlp_linears[-1].in_features if g.mlp_linears else 0  # Nemotron-H: mixer-only layers
        else:
            ops += [self._linear(lin, m, 1, L) for lin in g.mlp_linears]  # router, replicated
            ops += [self._linear(lin, m, tp, L) for lin in g.moe.shared_linears]
            ops.append(self._moe_experts(g, m))
            inter = g.moe.expert_linears[-1].in_features * g.moe.top_k
        # norms, residual adds, rotary, activation: memory-bound elementwise kernels (~4 per layer)
        elem_bytes = m * (6 * h + 3 * inter / tp) * self.ab
        e = self.roofline("elementwise", 0.0, elem_bytes, kernels=4)
        ops.append(OpCost("elementwise", 0.0, elem_bytes * L, e.time_s * L, e.bound))
        ops.append(self._allreduce("tp_all_reduce", m * h * self.ab, 2 * L))
        return ops

    def moe_imbalance_factor(self, assignments: float, ranks: int) -> float:
        """Expected max/mean load of `assignments` balls in `ranks` bins: 1 + sqrt(2 b ln b / n)."""
        if self.moe_imbalance is not None:
            return self.moe_imbalance
        if ranks <= 1 or assignments <= 0:
            return 1.0
        return min(float(ranks), 1.0 + math.sqrt(2.0 * ranks * math.log(ranks) / assignments))

    def _moe_experts(self, g: LayerGroup, m: int) -> OpCost:
        moe = g.moe
        assert moe is not None
        ep, tp, L = self.par.ep, self.par.tp, g.num_layers
        shard = 1 if ep > 1 else tp
        local_experts = moe.num_experts / ep
        assignments = m * moe.top_k
        per_rank = assignments / ep * self.moe_imbalance_factor(assignments, ep)
        active = local_experts * (1.0 - (1.0 - moe.top_k / moe.num_experts) ** m)
        flops = 2.0 * per_rank * moe.expert_params / shard
        w_bytes = active * moe.expert_params * self.wb_by_group["experts"] / shard
        a_bytes = per_rank * sum(lin.in_features + lin.out_features / shard for lin in moe.expert_linears) * self.ab
        c = self.roofline("moe_experts", flops, w_bytes + a_bytes, kernels=2, flops_s=self.flops_by_group["mlp"])
        t = c.time_s
        if ep > tp:  # experts live outside this TP group: dispatch + combine all-to-all
            nbytes = m * moe.top_k * self.model.hidden_size * self.ab / ep
            if self.cluster is not None:  # EP ranks span replicas: routed over the cluster's fabric
                t += 2 * cluster_collective_time(self.cluster, self.hw, "all_to_all", nbytes, list(range(ep)),
                                                 "pairwise")
            else:
                alpha, bw = self._comm_link(ep)
                t += 2 * collective_time("all_to_all", nbytes, ep, alpha, bw, "pairwise")
        return OpCost("moe_experts", flops * L, (w_bytes + a_bytes) * L, t * L, c.bound)

    def token_ops(self, m: int) -> list[OpCost]:
        """Ops whose cost depends only on the step's token count `m` (all layers, per device)."""
        ops: list[OpCost] = []
        for g in self.model.groups:
            ops += self._group_token_ops(g, m)
        emb = m * self.model.hidden_size * self.ab
        ops.append(self.roofline("embedding", 0.0, 2 * emb))
        if self.par.pp > 1:
            alpha, bw = self._comm_link(self.par.tp * self.par.pp)
            t = (self.par.pp - 1) * (alpha + emb / bw)
            ops.append(OpCost("pp_send", 0.0, emb * (self.par.pp - 1), t, "network"))
        return ops

    def _token_ops_time(self, m: int) -> float:
        return sum(op.time_s for op in self.token_ops(m))

    def logits_ops(self, num_seqs: int) -> list[OpCost]:
        """Final norm and LM head for the one position per sequence that is sampled."""
        lm = Linear("lm_head", self.model.hidden_size, self.model.vocab_size)
        return [self._linear(lm, num_seqs, self.par.tp, 1, "lm_head")]

    def _logits_time(self, num_seqs: int) -> float:
        return sum(op.time_s for op in self.logits_ops(num_seqs))

    # ---- attention ----------------------------------------------------------------------------
    def attention_ops(self, num_decode: int, decode_ctx_sum: float, prefill_chunks: list[tuple[int, int]],
                      decode_window_ctx_sum: float | None = None) -> list[OpCost]:
        """Attention for decode seqs (total context `decode_ctx_sum`) and prefill chunks (new, cached)."""
        ops: list[OpCost] = []
        heads_shard = self.par.tp
        T = self.flash_tile
        for g in self.model.groups:
            if g.linear is not None:
                ops += self._scan_ops(g, num_decode, prefill_chunks)
                continue
            if g.mamba is not None:
                ops += self._ssd_ops(g, num_decode, prefill_chunks)
                continue
            a = g.attention
            if not g.attn_linears:  # an MLP-only layer (Nemotron-H): no token mixer
                continue
            L = g.num_layers
            kv_tok = a.kv_elems_per_token / self.kv_shard * self.kvb
            fpp = a.flops_per_pair / heads_shard
            qo_tok = a.num_heads / heads_shard * (a.head_dim + a.v_head_dim) * self.ab
            flops = 0.0
            nbytes = 0.0
            kernels = 0
            if num_decode:
                span = decode_ctx_sum
                if a.sliding_window:
                    span = (decode_window_ctx_sum if decode_window_ctx_sum is not None
                            else min(decode_ctx_sum, num_decode * a.sliding_window))
                flops += fpp * span
                nbytes += kv_tok * span + num_decode * (qo_tok + kv_tok)
                kernels += 1
            for n, c in prefill_chunks:
                w = a.sliding_window
                pairs = _causal_pairs(n, c, w)
                tiles = math.ceil(n / T)
                keys_read = _causal_pairs(tiles, c / T, w / T if w else None) * T if n > T else (
                    min(c + n, w) if w else c + n)
                flops += fpp * pairs
                nbytes += kv_tok * keys_read + n * (qo_tok + kv_tok)
                kernels += 1
            if kernels:
                ops.append(self._attention_cost(flops, nbytes, kernels, L, kv_tok, num_decode, prefill_chunks, qo_tok))
        return ops

    def _attention_cost(self, flops: float, nbytes: float, kernels: int, layers: int, kv_tok: float,
                        num_decode: int, chunks: list[tuple[int, int]], qo_tok: float) -> OpCost:
        """One layer group's attention, split over `cp` context-parallel ranks, part of the KV on the host.

        Context parallelism (ring attention, Liu et al. 2023; Megatron-LM context parallel): each CP rank
        holds 1/cp of every sequence's KV and computes 1/cp of the (query, key) pairs; for prefill the KV
        shards travel around the ring, (cp-1) sends of one shard per layer, overlapped with compute
        (time = max(compute, ring)). Decode combines the ranks' partial outputs (and log-sum-exp) with one
        small all-gather per layer. KV offload: the fraction `host_kv_fraction` of the KV is read over
        the host link (`host_kv_gbps`) instead of device memory."""
        cp = self.par.cp
        flops, nbytes = flops / cp, nbytes / cp
        f = self.host_kv_fraction
        kv_bytes = nbytes if f else 0.0
        op = self.roofline("attention", flops, nbytes * (1 - f), kernels=min(kernels, 2),
                           flops_s=self.flops_by_group["sdpa"], scale=self.eff.attention)
        t = op.time_s
        if f:  # the offloaded part streams from host memory at the host link's rate
            t = max(t, kv_bytes * f / self.host_kv_bw + self.kernel_s)
        if cp > 1:
            alpha, bw = self._comm_link(self.par.tp * cp)  # the ring spans tp x cp devices
            ring = sum((cp - 1) * (alpha + (c + n) / cp * kv_tok / bw) for n, c in chunks)
            gather = collective_time("all_gather", num_decode * qo_tok * 2, cp, alpha, bw, "ring") if num_decode else 0.0
            t = max(t, ring) + gather
        return OpCost("attention", flops * layers, nbytes * layers, t * layers, op.bound)

    def _scan_ops(self, g: LayerGroup, num_decode: int, prefill_chunks: list[tuple[int, int]]) -> list[OpCost]:
        """A linear-attention group: the recurrence over every new token, reading and writing each
        sequence's state once per step (fp32, heads sharded by tp); no KV, so no context term."""
        la = g.linear
        assert la is not None
        num_tokens = num_decode + sum(n for n, _ in prefill_chunks)
        num_seqs = num_decode + len(prefill_chunks)
        if not num_tokens:
            return []
        flops = la.scan_flops_per_token * num_tokens / self.par.tp
        nbytes = 2 * 4 * la.state_elems * num_seqs / self.par.tp
        op = self.roofline("linear_attention_scan", flops, nbytes, kernels=1 + bool(prefill_chunks))
        L = g.num_layers
        return [OpCost("linear_attention_scan", flops * L, nbytes * L, op.time_s * L, op.bound)]

    def _ssd_ops(self, g: LayerGroup, num_decode: int, prefill_chunks: list[tuple[int, int]]) -> list[OpCost]:
        """A Mamba-2 group (heads sharded by tp): decode tokens run the recurrence (5 H P N FLOPs each),
        prefill chunks the chunked SSD scan (`Mamba2Desc.prefill_flops`); each sequence's SSM state
        (fp32) and conv state (activation dtype) are read and written once per step, and the scan reads
        x|B|C and dt and writes y per token (fp32 inside the kernel, activation dtype outside). No KV."""
        mb = g.mamba
        assert mb is not None
        num_tokens = num_decode + sum(n for n, _ in prefill_chunks)
        num_seqs = num_decode + len(prefill_chunks)
        if not num_tokens:
            return []
        tp = self.par.tp
        flops = (mb.decode_flops_per_token * num_decode + sum(mb.prefill_flops(n) for n, _ in prefill_chunks)) / tp
        state = 4 * mb.ssm_state_elems + self.ab * mb.conv_state_elems
        nbytes = (2 * state * num_seqs + num_tokens * (mb.conv_dim + mb.num_heads + mb.intermediate_size) * self.ab) / tp
        op = self.roofline("mamba2_scan", flops, nbytes, kernels=1 + bool(prefill_chunks))
        L = g.num_layers
        return [OpCost("mamba2_scan", flops * L, nbytes * L, op.time_s * L, op.bound)]

    # ---- whole step ---------------------------------------------------------------------------
    def step_time(self, num_tokens: int, num_seqs: int, num_decode: int = 0, decode_ctx_sum: float = 0.0,
                  prefill_chunks: list[tuple[int, int]] | tuple = (),
                  decode_window_ctx_sum: float | None = None) -> float:
        """Seconds for one step from aggregates; decode contexts count the token computed this step."""
        if num_tokens <= 0:
            return 0.0
        t = self.step_s + self.seq_s * num_seqs
        cp = self.par.cp
        for m, s, nd, ctx, chunks, wctx in self.forwards(num_tokens, num_seqs, num_decode, decode_ctx_sum,
                                                          prefill_chunks, decode_window_ctx_sum):
            t += self._token_cache(-(-m // cp)) + self._logits_cache(s)  # CP ranks share a step's tokens
            for op in self.attention_ops(nd, ctx, chunks, wctx):
                t += op.time_s
        return t

    def forwards(self, num_tokens: int, num_seqs: int, num_decode: int, decode_ctx_sum: float,
                 prefill_chunks: list[tuple[int, int]] | tuple, decode_window_ctx_sum: float | None = None,
                 ) -> list[tuple[int, int, int, float, list[tuple[int, int]], float | None]]:
        """The forwards one step runs: (tokens, seqs, decodes, decode context, prefill chunks, window ctx) each."""
        chunks = list(prefill_chunks)
        if self.runner == "fused" or not chunks:
            return [(num_tokens, num_seqs, num_decode, decode_ctx_sum, chunks, decode_window_ctx_sum)]
        out: list[tuple[int, int, int, float, list[tuple[int, int]], float | None]] = []
        if num_decode:
            out.append((num_decode, num_decode, num_decode, decode_ctx_sum, [], decode_window_ctx_sum))
        by_len: dict[int, list[tuple[int, int]]] = {}
        for n, c in chunks:
            by_len.setdefault(n, []).append((n, c))
        for n, group in by_len.items():
            out.append((n * len(group), len(group), 0, 0.0, group, None))
        return out

    # ---- pipeline parallelism ---------------------------------------------------------------------
    def pipelined_step_time(self, num_tokens: int, num_seqs: int, num_decode: int = 0, decode_ctx_sum: float = 0.0,
                            prefill_chunks: list[tuple[int, int]] | tuple = (), num_microbatches: int = 1,
                            schedule: str = "gpipe") -> tuple[float, float]:
        """(step seconds, busy seconds of one stage) when the step's work flows through `pp` stages.

        The batch is split into `m` micro-batches (decodes evenly, prefill chunks greedily by tokens);
        micro-batch i takes t_i = (its whole-model time - step overhead) / pp on every stage. `gpipe`
        flushes the pipeline every step: a flow shop whose jobs take equal time on every machine has
        makespan sum(t_i) + (pp-1) max(t_i), i.e. (m + pp - 1) t for equal micro-batches, bubble
        (pp-1)/(m+pp-1) (Huang et al., GPipe, 2019). `async` lets the next step's micro-batches enter
        stage 1 while this step drains (vLLM's virtual engines): the period is max(sum t_i, pp max t_i),
        a micro-batch's tokens must leave the last stage before its next step can start.
        """
        p = self.par.pp
        if p == 1 or num_tokens <= 0:
            t = self.step_time(num_tokens, num_seqs, num_decode, decode_ctx_sum, prefill_chunks)
            return t, max(t - self.step_s, 0.0) if num_tokens > 0 else 0.0
        stage_times = [
            (self.step_time(*mb) - self.step_s) / p
            for mb in split_microbatches(num_microbatches, num_decode, decode_ctx_sum, list(prefill_chunks))
        ]
        busy = sum(stage_times)
        longest = max(stage_times)
        if schedule == "gpipe":
            span = busy + (p - 1) * longest
        elif schedule == "async":
            span = max(busy, p * longest)
        else:
            raise ValueError(f"unknown pipeline schedule {schedule!r}: expected gpipe or async")
        return self.step_s + span, busy

    @staticmethod
    def _aggregate(batch: Batch, window: int | None) -> tuple[int, float, float | None, list[tuple[int, int]]]:
        num_decode = 0
        ctx = 0.0
        wctx = 0.0
        chunks: list[tuple[int, int]] = []
        for s in batch.seqs:
            if s.num_tokens == 1 and not s.is_prefill:
                num_decode += 1
                ctx += s.context_len
                wctx += min(s.context_len, window) if window else s.context_len
            else:
                chunks.append((s.num_tokens, s.num_computed_tokens))
        return num_decode, ctx, (wctx if window else None), chunks

    def time(self, batch: Batch) -> float:
        """Predicted seconds for the step the engine would run for `batch`."""
        windows = [g.attention.sliding_window for g in self.model.groups if g.attention.sliding_window]
        num_decode, ctx, wctx, chunks = self._aggregate(batch, windows[0] if windows else None)
        return self.step_time(batch.num_tokens, batch.num_seqs, num_decode, ctx, chunks, wctx)

    def step_ops(self, batch: Batch) -> list[OpCost]:
        """Every op of every forward of `batch` (without the step and sequence overheads)."""
        windows = [g.attention.sliding_window for g in self.model.groups if g.attention.sliding_window]
        num_decode, ctx, wctx, chunks = self._aggregate(batch, windows[0] if windows else None)
        ops: list[OpCost] = []
        for m, s, nd, c, ch, w in self.forwards(batch.num_tokens, batch.num_seqs, num_decode, ctx, chunks, wctx):
            ops += self.token_ops(m) + self.logits_ops(s) + self.attention_ops(nd, c, ch, w)
        return ops

    def breakdown(self, batch: Batch) -> list[OpCost]:
        """Per-op costs of `batch`, merged by op name, plus the step and per-sequence overheads."""
        raw = self.step_ops(batch)
        merged: dict[str, OpCost] = {}
        for op in raw:
            if op.name in merged:
                o = merged[op.name]
                merged[op.name] = OpCost(op.name, o.flops + op.flops, o.bytes + op.bytes, o.time_s + op.time_s, o.bound)
            else:
                merged[op.name] = op
        out = list(merged.values())
        out.append(OpCost("step_overhead", 0.0, 0.0, self.step_s, "overhead"))
        if self.seq_s:
            out.append(OpCost("seq_overhead", 0.0, 0.0, self.seq_s * batch.num_seqs, "overhead"))
        return out


def _causal_pairs(n: float, c: float, window: float | None) -> float:
    """(query, key) pairs when n new queries at positions c..c+n-1 attend causally (within `window`)."""
    full = n * c + n * (n + 1) / 2
    if not window:
        return full
    # query i (0-based) sees min(c + i + 1, window) keys
    k = max(0.0, min(n, window - c))  # queries still below the window
    below = k * c + k * (k + 1) / 2 if k > 0 else 0.0
    return below + (n - k) * window


def split_microbatches(m: int, num_decode: int, decode_ctx_sum: float, chunks: list[tuple[int, int]],
                       ) -> list[tuple[int, int, int, float, list[tuple[int, int]]]]:
    """Split one step into <= m micro-batches: (tokens, seqs, decodes, decode context, prefill chunks) each.

    Decodes are dealt evenly (context in proportion); prefill chunks go, largest first, to the
    micro-batch with the fewest tokens so far. Empty micro-batches are dropped.
    """
    m = max(1, min(m, num_decode + len(chunks)))
    nd = [num_decode // m + (1 if i < num_decode % m else 0) for i in range(m)]
    tokens = list(nd)
    parts: list[list[tuple[int, int]]] = [[] for _ in range(m)]
    for n, c in sorted(chunks, key=lambda x: -x[0]):
        i = min(range(m), key=tokens.__getitem__)
        parts[i].append((n, c))
        tokens[i] += n
    out = []
    for i in range(m):
        if tokens[i] == 0:
            continue
        ctx = decode_ctx_sum * nd[i] / num_decode if num_decode else 0.0
        out.append((tokens[i], nd[i] + len(parts[i]), nd[i], ctx, parts[i]))
    return out
