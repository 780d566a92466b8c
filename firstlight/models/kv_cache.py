"""The KV-cache contract between a model and whoever owns the memory.

A model's forward takes `positions` and a `KVCache`. Per forward pass:

    key_positions = cache.begin(positions)        # once, before the layers
    k_all, v_all = cache.update(layer, k, v)      # in every attention layer
    cache.end()                                   # once, after the layers

Layers with a recurrent state instead of K/V (linear attention, SSM) read and write it through

    state = cache.get_state(layer)                # None: a fresh sequence (the mixer starts from zeros)
    cache.set_state(layer, *state)                # after the pass: the state after its last token

so a chunked prefill carries the state from chunk to chunk, as attention layers carry their K/V.
A cache whose `keep_token_states` is True (the engine's speculative verify pass) also receives the
state after every token of the pass, `set_token_states(layer, conv [B, S, C, K-1], ssm [B, S, ...])`,
so that the state after any accepted prefix can be restored when later proposals are rejected.

`positions[b, s]` is the absolute position of new token s of row b, or -1 for padding.
`key_positions[b, j]` is the absolute position of key j in the tensors `update` returns, or -1 where
that slot holds no key. A cache that gathers different keys for different layer types (the engine's
paged cache gathers only the window for sliding-window layers) returns a dict {layer type: [B, L_t]}. The model builds its masks from (positions, key_positions, sliding window),
so a cache is free to lay memory out as it likes: contiguous (below), or paged blocks gathered
through a block table (the engine's cache).

Optionally, a cache may attend itself instead of returning gathered keys: `out = cache.attend(layer, q, k, v,
mask, scale)` (mask: the model's boolean [B, 1, S, L], CAUSAL or None) stores k, v as `update` would and returns
the attention output [B, H, S, D] over the same keys under that mask, or None, having stored nothing, to decline
(the model then calls `update` and runs SDPA). The engine's paged cache reads its pools in place at decode
and runs its own kernel on prefill chunks.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        """Register the new tokens' positions [B, S]; return the key positions [B, L] of this pass."""
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values k, v: [B, Hkv, S, D]; return all keys/values [B, Hkv, L, D]."""
        ...

    def end(self) -> None:
        """Commit the pass (advance lengths)."""
        ...

    def get_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """A recurrent layer's state per row before this pass, or None if the rows start fresh."""
        ...

    def set_state(self, layer: int, *state: torch.Tensor) -> None:
        """Store a recurrent layer's state after this pass."""
        ...


class NoCache:
    """Attend only over the tokens of this pass (a plain full forward)."""

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def end(self) -> None:
        pass

    def get_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        return None

    def set_state(self, layer: int, *state: torch.Tensor) -> None:
        pass


class ContiguousKVCache:
    """Preallocated [B, Hkv, max_len, D] per layer; every row holds the same number of tokens.

    Used by `generate` and the parity tests; the engine replaces it with a paged cache.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0  # tokens committed
        self._new = 0  # tokens in the pass being run
        self.states: dict[int, tuple[torch.Tensor, ...]] = {}  # recurrent layers: state after `length` tokens

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        batch, new = positions.shape
        if self.length + new > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {new} tokens > max_len {self.max_len}")
        self._new = new
        key_positions = torch.arange(self.length + new, device=positions.device)
        return key_positions.unsqueeze(0).expand(batch, -1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + self._new
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def end(self) -> None:
        self.length += self._new
        self._new = 0

    def get_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        return self.states.get(layer)

    def set_state(self, layer: int, *state: torch.Tensor) -> None:
        self.states[layer] = state
