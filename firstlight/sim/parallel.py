"""Parallel mappings (tensor, pipeline, expert, data) of a model onto devices, and memory fit.

One replica spans tp * pp devices; dp counts replicas. Expert parallelism splits routed experts
over `ep` ranks drawn from the tp x dp devices (ep = 1: every expert is tensor-parallel instead).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from firstlight.core.hardware import DTYPE_BYTES, HardwareSpec
from firstlight.errors import FirstlightError
from firstlight.sim.model import ModelDesc

GB = 1e9


class ParallelError(FirstlightError):
    """A parallel mapping the model's shape does not allow."""


class DoesNotFitError(FirstlightError):
    """Weights + KV + activations exceed device memory."""


class ParallelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)  # context parallel: each sequence's tokens and KV split over cp ranks

    @property
    def devices_per_replica(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={self.ep} dp={self.dp}" + (f" cp={self.cp}" if self.cp > 1 else "")


def check_parallel(model: ModelDesc, par: ParallelConfig) -> None:
    """Raise ParallelError naming the degree and the dimension it does not divide."""
    for g in model.groups:
        att = g.attention
        if att.num_heads % par.tp:
            raise ParallelError(
                f"tensor parallel degree --tp {par.tp} does not divide num_attention_heads={att.num_heads} of "
                f"{model.name}; choose tp from {[d for d in range(1, att.num_heads + 1) if att.num_heads % d == 0][:8]}"
            )
        if not att.is_mla and att.num_kv_heads % par.tp and par.tp % att.num_kv_heads:
            raise ParallelError(
                f"tp={par.tp} and num_key_value_heads={att.num_kv_heads} of {model.name}: one must divide the other "
                "(KV heads are split, or replicated when tp > num_key_value_heads)"
            )
    if par.pp > model.num_layers:
        raise ParallelError(f"pipeline degree --pp {par.pp} exceeds the {model.num_layers} layers of {model.name}")
    if par.ep > 1:
        if not model.is_moe:
            raise ParallelError(f"expert parallel --ep {par.ep} given but {model.name} has no experts; use ep=1")
        if model.num_experts % par.ep:
            raise ParallelError(f"--ep {par.ep} does not divide the {model.num_experts} experts of {model.name}")
        if (par.tp * par.dp) % par.ep or (par.ep > par.tp and par.ep % par.tp):
            raise ParallelError(
                f"--ep {par.ep} does not divide the {par.tp * par.dp} devices of --tp {par.tp} x --replicas {par.dp} "
                "(EP ranks come from the TP x DP devices; an EP group spanning replicas must be whole TP groups): "
                f"choose --ep from {[d for d in range(1, par.tp * par.dp + 1) if (par.tp * par.dp) % d == 0 and (d <= par.tp or d % par.tp == 0)]}")


def kv_shard(model: ModelDesc, par: ParallelConfig) -> int:
    """How many ways the KV cache of one layer is split across TP ranks (MLA latents are replicated)."""
    att = model.attention_group.attention  # a KV-keeping group (hybrids: not the first linear/SSM group)
    return 1 if att.is_mla else min(par.tp, att.num_kv_heads)


def weight_bytes_per_device(model: ModelDesc, par: ParallelConfig) -> float:
    """Bytes of weights one device holds, each tensor group at its profile dtype."""
    by = model.weight_bytes_by_group()
    emb_bytes_per_param = by["embedding"] / model.params_by_group()["embedding"]
    emb_one = model.vocab_size * model.hidden_size * emb_bytes_per_param
    emb = model.embedding_params() * emb_bytes_per_param
    body = by["attention"] + by["mlp"] + by["embedding"] - emb  # + norms
    expert_shard = par.ep if par.ep > 1 else par.tp
    # with pp > 1 the input embedding sits on the first stage and the LM head on the last
    emb_dev = (emb if par.pp == 1 else emb_one) / par.tp
    return body / (par.tp * par.pp) + by["experts"] / (expert_shard * par.pp) + emb_dev


def kv_bytes_per_token_per_device(model: ModelDesc, par: ParallelConfig) -> float:
    return model.kv_bytes_per_token() / kv_shard(model, par) / par.pp / par.cp


def activation_bytes_per_device(model: ModelDesc, par: ParallelConfig, max_num_batched_tokens: int,
                                max_num_seqs: int) -> float:
    """Peak transient memory of one step: the widest intermediate plus fp32 logits (an estimate)."""
    ab = DTYPE_BYTES[model.profile.activations]
    widest = 0
    for g in model.groups:
        for lin in g.mlp_linears + g.attn_linears + (g.moe.shared_linears if g.moe else ()):
            widest = max(widest, lin.out_features)
    per_token = (4 * model.hidden_size + 2 * widest / par.tp) * ab
    logits = max_num_seqs * model.vocab_size / par.tp * 4
    return max_num_batched_tokens * per_token + logits


@dataclass(frozen=True)
class MemoryPlan:
    capacity_bytes: float  # usable: capacity * memory_utilization
    weight_bytes: float
    activation_bytes: float
    kv_bytes_per_token: float
    kv_capacity_tokens: int
    state_bytes_per_seq: float = 0.0  # linear-attention / SSM layers: fixed per sequence, beside the KV
    max_num_seqs: int = 0

    @property
    def state_bytes(self) -> float:
        """The recurrent state of `max_num_seqs` sequences, held back before the KV gets the rest."""
        return self.state_bytes_per_seq * self.max_num_seqs

    def to_dict(self) -> dict[str, float]:
        out = {
            "capacity_gb": self.capacity_bytes / GB,
            "weight_gb": self.weight_bytes / GB,
            "activation_gb": self.activation_bytes / GB,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": self.kv_capacity_tokens,
        }
        if self.state_bytes_per_seq:
            out |= {"state_bytes_per_seq": self.state_bytes_per_seq, "state_gb": self.state_bytes / GB}
        return out


def plan_memory(model: ModelDesc, hw: HardwareSpec, par: ParallelConfig, max_num_batched_tokens: int = 8192,
                max_num_seqs: int = 256, memory_utilization: float = 0.9, min_kv_tokens: int = 0) -> MemoryPlan:
    """Per-device memory plan; DoesNotFitError when weights + activations + min KV exceed it."""
    check_parallel(model, par)
    cap = hw.memory.capacity_bytes * memory_utilization
    w = weight_bytes_per_device(model, par)
    act = activation_bytes_per_device(model, par, max_num_batched_tokens, max_num_seqs)
    kv_tok = kv_bytes_per_token_per_device(model, par)
    # linear-attention / SSM layers: a fixed state per sequence (heads split by tp, layers by pp), held
    # for every sequence the scheduler may run at once
    state_seq = model.state_bytes_per_seq() / par.tp / par.pp
    state = state_seq * max_num_seqs
    need = w + act + state + min_kv_tokens * kv_tok
    free = cap - w - act - state
    if need > cap or free <= 0:
        st = f" + recurrent state of {max_num_seqs} sequences {state / GB:.1f}" if state else ""
        raise DoesNotFitError(
            f"{model.name} on {hw.name} with {par.describe()} does not fit: needs {need / GB:.1f} GB per device "
            f"(weights {w / GB:.1f} + activations {act / GB:.1f}{st} + KV for {min_kv_tokens} tokens "
            f"{min_kv_tokens * kv_tok / GB:.1f}), has {cap / GB:.1f} GB ({memory_utilization:.0%} of "
            f"{hw.memory.capacity_gib} GiB); raise tp/pp, lower max_num_batched_tokens, or pick a larger device"
        )
    return MemoryPlan(cap, w, act, kv_tok, int(free // kv_tok) if kv_tok > 0 else 10**12, state_seq, max_num_seqs)


def pipeline_time(stage_time_s: float, num_microbatches: int, pp: int, p2p_time_s: float = 0.0) -> float:
    """GPipe schedule: (m + p - 1) slots of one stage (+ its send); bubble fraction (p-1)/(m+p-1)."""
    return (num_microbatches + pp - 1) * (stage_time_s + p2p_time_s)


def pipeline_bubble_fraction(num_microbatches: int, pp: int) -> float:
    return (pp - 1) / (num_microbatches + pp - 1)
