"""The draft proposer's KV cache for many requests at once: one slot (row) per request in a shared
[num_slots, Hkv, max_len, D] tensor per layer, each slot with its own length.

A forward over some slots is one `SlotPass` (the KVCache contract of models/kv_cache.py): every row
runs the same number of new tokens S, written at that row's own offset (its own positions). Key j of
a slot holds position j, so the keys past a shorter row's end are in its future and the model's
causal mask hides them: rows of different lengths share a pass with no extra mask.
Rolling a request back is `truncate(slot, n)`: the stale keys past n are overwritten by the next pass.

Occupied slots are kept dense (0 .. n-1): freeing a slot moves the last one into it, so a pass over
all running requests reads the pool through a slice view instead of gathering rows.
"""

from __future__ import annotations

import torch


class DraftKVPool:
    """Per-request draft KV (and the tokens it holds) in shared slot tensors that grow on demand."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        first_layer: int = 0,
    ) -> None:
        """first_layer: the model's index of the pool's layer 0 (an MTP layer caches as layer num_layers + i)."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.first_layer = first_layer
        self.dtype, self.device = dtype, device
        self.k = [self._zeros(0, 0) for _ in range(num_layers)]  # [num_slots, Hkv, max_len, D]
        self.v = [self._zeros(0, 0) for _ in range(num_layers)]
        self.slot_of: dict[str, int] = {}  # request id -> slot; slots 0 .. len-1 are occupied
        self.tokens: list[list[int]] = []  # per occupied slot: the tokens whose keys it holds

    def _zeros(self, num_slots: int, max_len: int) -> torch.Tensor:
        return torch.zeros(num_slots, self.num_kv_heads, max_len, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def length(self, slot: int) -> int:
        return len(self.tokens[slot])

    def acquire(self, request_id: str) -> int:
        """The request's slot, taking the next free one (empty) on first use."""
        if request_id not in self.slot_of:
            self.slot_of[request_id] = len(self.tokens)
            self.tokens.append([])
            self.reserve(len(self.tokens), self.max_len)
        return self.slot_of[request_id]

    def free(self, request_id: str) -> None:
        """Release a request's slot; the last occupied slot moves into it (slots stay dense)."""
        slot = self.slot_of.pop(request_id, None)
        if slot is None:
            return
        last = len(self.tokens) - 1
        if slot != last:
            moved = next(r for r, s in self.slot_of.items() if s == last)
            n = len(self.tokens[last])
            with torch.inference_mode():  # the pool's tensors are made inside the proposer's inference mode
                for kv in (self.k, self.v):
                    for t in kv:
                        t[slot, :, :n] = t[last, :, :n]
            self.tokens[slot] = self.tokens[last]
            self.slot_of[moved] = slot
        self.tokens.pop()

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens of a slot (rollback of rejected draft tokens)."""
        del self.tokens[slot][length:]

    def reserve(self, num_slots: int, max_len: int) -> None:
        """Grow to at least num_slots x max_len (2x, amortized O(1) per token), keeping the contents."""
        if num_slots <= self.num_slots and max_len <= self.max_len:
            return
        new_slots = max(self.num_slots, num_slots if num_slots <= self.num_slots else max(4, 2 * num_slots))
        new_len = max(self.max_len, max_len if max_len <= self.max_len else max(64, 2 * max_len))
        old_slots, old_len = self.num_slots, self.max_len
        for kv in (self.k, self.v):
            for i, t in enumerate(kv):
                grown = self._zeros(new_slots, new_len)
                grown[:old_slots, :, :old_len] = t
                kv[i] = grown

    def pass_over(self, slots: list[int], new_tokens: list[list[int]]) -> SlotPass:
        """A KVCache for one forward that appends new_tokens[b] (all of one length S) to slots[b]."""
        return SlotPass(self, slots, new_tokens)


class SlotPass:
    """One forward over some slots of a DraftKVPool: S new tokens per row at per-row offsets."""

    def __init__(self, pool: DraftKVPool, slots: list[int], new_tokens: list[list[int]]) -> None:
        self.pool, self.slots, self.new_tokens = pool, slots, new_tokens
        device = pool.device
        self.starts = [pool.length(s) for s in slots]
        self.num_new = len(new_tokens[0])
        starts = torch.tensor(self.starts, device=device)
        offsets = torch.arange(self.num_new, device=device)
        self.positions = starts[:, None] + offsets  # [B, S] absolute positions of the new tokens
        self.num_keys = max(self.starts) + self.num_new
        pool.reserve(max(slots) + 1, self.num_keys)
        b0 = slots[0]
        self._view = slots == list(range(b0, b0 + len(slots)))  # dense run: read a slice, no gather
        self._rows = torch.tensor(slots, device=device)

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        # [B, L]: key j is position j in every row (those past a row's end are causally masked)
        return torch.arange(self.num_keys, device=positions.device).expand(len(self.slots), -1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        layer -= self.pool.first_layer
        for pool_t, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):
            # new: [B, Hkv, S, D] -> rows[b], :, positions[b, s]; advanced indices first: [B, S, Hkv, D]
            pool_t[self._rows[:, None], :, self.positions] = new.transpose(1, 2)
            if self._view:
                b0 = self.slots[0]
                out.append(pool_t[b0 : b0 + len(self.slots), :, : self.num_keys])
            else:
                out.append(pool_t[self._rows, :, : self.num_keys])
        return out[0], out[1]

    def end(self) -> None:
        for slot, toks in zip(self.slots, self.new_tokens, strict=True):
            self.pool.tokens[slot].extend(toks)
