"""The model runner: executes a Batch over the paged KV cache and returns logits to sample from.

Memory: per layer one K pool and one V pool of shape [num_blocks * block_size, Hkv, D]; token t of
a request lives in slot `block_ids[t // block_size] * block_size + t % block_size`.

`PagedKVCache` implements the model's KV contract (firstlight/models/kv_cache.py) for one forward:
`update` scatters the new K/V into their slots, then gathers each row's keys through its block
table into [B, Hkv, L, D] (L = the longest context in the group; shorter rows get key position -1
there, which the model masks) and the model runs SDPA on that. This is the "gather + SDPA" path:
simple and correct on any backend; a paged-attention kernel would read the pool directly.

Grouping (to keep padding small): all decode rows (1 token each) run as one [B, 1] forward, padded
only in L; prefill chunks run grouped by equal chunk length ([B, S], no padding at all), so a
step runs at most 1 + (number of distinct chunk lengths) forwards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.engine.request import Request


class PagedKVCache:
    """One forward's view of the pools: where to write new K/V and what to gather per row."""

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        write_slots: torch.Tensor,
        write_rows: torch.Tensor,
        gather_slots: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> None:
        self.k_pools, self.v_pools = k_pools, v_pools
        self.write_slots = write_slots  # [N] pool slots of the valid new tokens
        self.write_rows = write_rows  # [N] their index in the flattened [B*S] new tokens
        self.gather_slots = gather_slots  # [B, L]
        self.key_positions = key_positions  # [B, L], -1 = no key

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        return self.key_positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_kv_heads, seq, head_dim = k.shape  # k: [B, Hkv, S, D]
        k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]  # [slots, Hkv, D]
        k_new = k.transpose(1, 2).reshape(batch * seq, num_kv_heads, head_dim)
        v_new = v.transpose(1, 2).reshape(batch * seq, num_kv_heads, head_dim)
        if self.write_rows.numel() != batch * seq:
            k_new, v_new = k_new[self.write_rows], v_new[self.write_rows]
        k_pool.index_copy_(0, self.write_slots, k_new.to(k_pool.dtype))
        v_pool.index_copy_(0, self.write_slots, v_new.to(v_pool.dtype))
        k_all = k_pool[self.gather_slots].transpose(1, 2)  # [B, Hkv, L, D]
        v_all = v_pool[self.gather_slots].transpose(1, 2)
        return k_all, v_all

    def end(self) -> None:
        pass


@dataclass
class ExecuteOutput:
    """Logits of the rows to sample (one per request that reached its last known token)."""

    sample_ids: list[str] = field(default_factory=list)
    sample_logits: torch.Tensor | None = None  # [N, V]
    # speculative rows: logits at the last known token and at each proposal, [1 + k, V]
    spec_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    # with `keep_hidden`: final hidden states at those same positions, [1 + k, E] (k = 0: [1, E])
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # rid -> [num_tokens, V]
    num_forwards: int = 0


def _input_ids(request: Request, seq: ScheduledSeq) -> list[int]:
    """The tokens a row computes: known tokens, then (speculative decode) the proposals."""
    stop = seq.context_len - seq.num_spec_tokens
    return request.token_ids_slice(seq.num_computed_tokens, stop) + request.spec_token_ids[: seq.num_spec_tokens]


class ModelRunner:
    """Owns the KV pools; turns a Batch into forwards and logits."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: str | torch.device = "cpu",
        compile_decode: bool = False,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_pools = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.keep_hidden = False  # a heads proposer needs the hidden states that sampled
        self._forward: Callable[..., torch.Tensor] = model.forward_hidden
        self._decode_forward: Callable[..., torch.Tensor] = model.forward_hidden
        if compile_decode:
            self._decode_forward = torch.compile(model.forward_hidden, dynamic=True)

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int) -> int:
        cfg = model.config
        itemsize = next(model.parameters()).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    @torch.inference_mode()
    def execute(self, batch: Batch, requests: dict[str, Request]) -> ExecuteOutput:
        out = ExecuteOutput()
        groups: dict[int, list[ScheduledSeq]] = defaultdict(list)
        for seq in batch.seqs:
            groups[seq.num_tokens].append(seq)
        logits_by_id: dict[str, torch.Tensor] = {}
        for num_tokens, seqs in sorted(groups.items()):
            self._run_group(seqs, num_tokens, requests, logits_by_id, out)
            out.num_forwards += 1
        out.sample_ids = [s.request_id for s in batch.seqs if s.request_id in logits_by_id and not s.num_spec_tokens]
        out.spec_logits = {s.request_id: logits_by_id[s.request_id] for s in batch.seqs if s.num_spec_tokens}
        if out.sample_ids:
            out.sample_logits = torch.stack([logits_by_id[rid] for rid in out.sample_ids])
        return out

    def _run_group(
        self,
        seqs: list[ScheduledSeq],
        num_tokens: int,
        requests: dict[str, Request],
        logits_by_id: dict[str, torch.Tensor],
        out: ExecuteOutput,
    ) -> None:
        dev = self.device
        input_ids = torch.tensor(
            [_input_ids(requests[s.request_id], s) for s in seqs], dtype=torch.long
        ).to(dev)  # [B, S]
        starts = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.long)
        positions = (starts[:, None] + torch.arange(num_tokens)).to(dev)  # [B, S]
        cache = self._make_cache(seqs, positions)
        forward = self._decode_forward if num_tokens == 1 else self._forward
        hidden = forward(input_ids, positions, cache)  # [B, S, E]

        want_prompt = [
            requests[s.request_id].sampling_params.prompt_logprobs is not None and s.is_prefill for s in seqs
        ]
        for i, s in enumerate(seqs):
            if want_prompt[i]:
                out.prompt_logits[s.request_id] = self.model.compute_logits(hidden[i]).float()
        rows = [i for i, s in enumerate(seqs) if s.context_len - s.num_spec_tokens == requests[s.request_id].num_tokens]
        if not rows:
            return
        spec = [i for i in rows if seqs[i].num_spec_tokens]
        if len(spec) < len(rows):
            plain = [i for i in rows if not seqs[i].num_spec_tokens]
            last = hidden[plain, -1]  # [N, E]: the last token of each row that samples
            logits = self.model.compute_logits(last)
            for j, i in enumerate(plain):
                logits_by_id[seqs[i].request_id] = logits[j]
                if self.keep_hidden:
                    out.hidden[seqs[i].request_id] = last[j : j + 1]
        for i in spec:  # the last known token and the k proposals: k + 1 distributions to verify
            h = hidden[i, -(seqs[i].num_spec_tokens + 1) :]  # [1 + k, E]
            logits_by_id[seqs[i].request_id] = self.model.compute_logits(h)
            if self.keep_hidden:
                out.hidden[seqs[i].request_id] = h

    def _make_cache(self, seqs: list[ScheduledSeq], positions: torch.Tensor) -> PagedKVCache:
        bs = self.block_size
        max_blocks = max(len(s.block_ids) for s in seqs)
        tables = torch.tensor([list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)) for s in seqs])
        context = torch.tensor([s.context_len for s in seqs])  # [B]
        num_keys = int(context.max())
        j = torch.arange(num_keys)
        gather_slots = tables[:, j // bs] * bs + j % bs  # [B, L]
        valid = j[None, :] < context[:, None]
        key_positions = torch.where(valid, j[None, :], -1)
        gather_slots = torch.where(valid, gather_slots, 0)
        pos = positions.cpu()
        write_slots = tables.gather(1, pos // bs) * bs + pos % bs  # [B, S]; every new token is valid
        dev = self.device
        return PagedKVCache(
            self.k_pools,
            self.v_pools,
            write_slots.reshape(-1).to(dev),
            torch.arange(write_slots.numel(), device=dev),
            gather_slots.to(dev),
            key_positions.to(dev),
        )
