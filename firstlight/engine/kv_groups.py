"""Two KV cache groups for models that mix full-attention and sliding-window layers (Gemma 3: 5 local
layers per global one), as vLLM's hybrid allocator keeps one group per attention type.

Pure bookkeeping, no torch. The full-attention layers' pools are paged by one `KVCacheManager` (every
block of the context stays), the sliding-window layers' pools by a second one with `sliding_window`
set, which releases each block once it is out of the window (kv_manager.py). Each request has one
table per group; the Batch carries both (`ScheduledSeq.block_ids` for the full layers,
`sliding_block_ids` for the local ones). The sliding group is sized for the running requests'
windows, not their contexts (`sliding_blocks_needed`), so on Gemma 3 five sixths of the KV bytes stop
growing with the context.

Prefix caching works per group: a hit is the longest prefix whose blocks both groups still hold
(released sliding blocks keep their keys in the free queue until reused, so a recent prefix still
hits; the out-of-window ones a hit takes back are released again after the step). vLLM goes further
and needs only the window's tail of the prefix in the sliding group; not done here.
"""

from __future__ import annotations

from dataclasses import dataclass

from firstlight.engine.kv_manager import KVCacheManager, PrefixCacheStats
from firstlight.engine.request import Request


@dataclass(frozen=True)
class GroupHits:
    """Prefix-cache hits of one request in each group (same number of blocks)."""

    full: tuple[int, ...] = ()
    sliding: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.full)


def sliding_blocks_needed(window: int, block_size: int, max_num_seqs: int, max_step_tokens: int) -> int:
    """Sliding-group blocks that `max_num_seqs` requests can hold at once: each keeps the W - 1 keys
    before its step plus the step's own tokens, over at most two partial blocks."""
    return max_num_seqs * (-(-(window - 1 + max_step_tokens) // block_size) + 1)


class SlidingWindowGroups:
    """The scheduler's KV manager for full + sliding layers: the same calls as KVCacheManager, applied
    to both groups; occupancy is the fuller group's."""

    def __init__(self, full: KVCacheManager, sliding: KVCacheManager) -> None:
        if sliding.sliding_window is None or full.sliding_window is not None:
            raise ValueError("SlidingWindowGroups wants a full-attention manager and a sliding-window one")
        if full.block_size != sliding.block_size:
            raise ValueError("both groups must use one block size")
        self.full, self.sliding = full, sliding
        self.block_size = full.block_size
        self.num_blocks = full.num_blocks  # caps the context length (scheduler): the full group holds it all
        self.enable_prefix_caching = full.enable_prefix_caching

    # ---- occupancy -------------------------------------------------------------------------
    @property
    def block_tables(self) -> dict[str, list[int]]:
        return self.full.block_tables

    @property
    def stats(self) -> PrefixCacheStats:
        return self.full.stats

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.sliding.usage)

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.full.num_used_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return self.full.num_blocks_for(num_tokens)

    # ---- the KVCacheManager calls ------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[GroupHits, int]:
        full, _ = self.full.get_computed_blocks(request)
        sliding, _ = self.sliding.get_computed_blocks(request)
        n = min(len(full), len(sliding))
        dropped = len(full) - n  # counted as hits by the full group, but the sliding group lacks them
        self.full.stats.num_hit_blocks -= dropped
        self.full.stats.num_hit_tokens -= dropped * self.block_size
        return GroupHits(tuple(full[:n]), tuple(sliding[:n])), n * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: GroupHits | tuple = ()) -> bool:
        hits = computed_blocks or GroupHits()
        return self.full.can_allocate(request, num_new_tokens, hits.full) and self.sliding.can_allocate(
            request, num_new_tokens, hits.sliding)

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: GroupHits | tuple = ()) -> list[int]:
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            raise RuntimeError(f"out of KV blocks for request {request.request_id}")
        hits = computed_blocks or GroupHits()
        self.sliding.allocate(request, num_new_tokens, hits.sliding)
        return self.full.allocate(request, num_new_tokens, hits.full)

    def free(self, request_id: str) -> None:
        self.full.free(request_id)
        self.sliding.free(request_id)

    def trim(self, request_id: str, num_tokens: int) -> int:
        self.sliding.trim(request_id, num_tokens)
        return self.full.trim(request_id, num_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        self.full.cache_full_blocks(request)
        self.sliding.cache_full_blocks(request)

    def release_out_of_window(self, request: Request) -> int:
        return self.sliding.release_out_of_window(request)

    def num_held_blocks(self, request_id: str) -> int:
        return self.full.num_held_blocks(request_id)

    def seq_block_ids(self, request_id: str) -> dict[str, tuple[int, ...]]:
        return {"block_ids": tuple(self.full.block_tables[request_id]),
                "sliding_block_ids": tuple(self.sliding.block_tables[request_id])}

    def reset_prefix_cache(self) -> int:
        return self.full.reset_prefix_cache() + self.sliding.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.full.check_invariants()
        self.sliding.check_invariants()
        assert set(self.full.block_tables) == set(self.sliding.block_tables), "groups hold different requests"
        for rid, table in self.full.block_tables.items():
            assert len(self.sliding.block_tables[rid]) == len(table), f"{rid}: group tables cover different tokens"
