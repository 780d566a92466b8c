"""KV-cache block manager: fixed-size blocks, per-request block tables, ref counts, prefix caching.

Pure bookkeeping, no torch: the runner owns the tensors, this module only hands out block ids.

Prefix caching follows vLLM v1 (docs/design/prefix_caching): a *full* block of computed tokens is
keyed by hash(parent block's hash, its token ids), so equal keys mean equal prefixes. A block whose
ref count drops to zero keeps its key and sits in the free queue; it is reused on a hit, and
evicted (its key dropped) only when a fresh block is needed. Blocks are freed in reverse order so
the tail of a sequence is evicted before its head. Every block is at any time either in use
(ref count > 0) or in the free queue, so `num_used_blocks + num_free_blocks == num_blocks`.

Sliding-window layers (`sliding_window=W`): once a request has computed n tokens, no later query
(position >= n) can see a key before position n - W + 1, so every block wholly before it is released
after each step (`release_out_of_window`) and its table entry becomes NULL_BLOCK: the table stays
positional (block i holds tokens i*B..i*B+B-1), and a request holds about (W + chunk) / B blocks however
long it grows. A released full block keeps its prefix key in the free queue like any freed block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from firstlight.engine.request import Request

NULL_BLOCK = -1  # a table entry whose block was released (out of every sliding layer's window)


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens the hash covers, checked on a hit


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # requests looked up
    num_query_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # of those, served from cache
    num_hit_blocks: int = 0
    num_evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Key of a full block: its tokens chained with the key of the block before it."""
    return hash((parent_hash, token_ids))


class KVCacheManager:
    """Hands out KV blocks to requests and remembers full blocks for prefix reuse."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
        self.sliding_window = sliding_window
        self._num_released: dict[str, int] = {}  # per request: leading table entries already NULL
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[int]] = {}  # per request: keys of its registered full blocks
        self.stats = PrefixCacheStats()

    # ---- occupancy -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix lookup ---------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks that hold a prefix of the request's tokens, and how many tokens they cover.

        At least one token is always left to compute, since the last one's logits are needed.
        Does not take the blocks; `allocate` does.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = h
        self.stats.num_queries += 1
        self.stats.num_query_tokens += len(tokens)
        self.stats.num_hit_blocks += len(hits)
        self.stats.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # ---- allocation ------------------------------------------------------------------------
    def _num_new_blocks(self, request_id: str, num_total_tokens: int, num_computed_blocks: int) -> int:
        have = len(self.block_tables.get(request_id, ())) + num_computed_blocks
        return max(0, self.num_blocks_for(num_total_tokens) - have)

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | tuple[int, ...] = ()
    ) -> bool:
        """Whether `allocate` would succeed for `num_new_tokens` more tokens this step."""
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self._num_new_blocks(request.request_id, num_computed + num_new_tokens, len(computed_blocks))
        # cached hits that sit in the free queue stop being free once taken
        num_free_hits = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return need <= self.num_free_blocks - num_free_hits

    def allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | tuple[int, ...] = ()
    ) -> list[int]:
        """Give the request blocks for `num_new_tokens` more tokens (after any prefix hits).

        `computed_blocks` (from `get_computed_blocks`, only on admission) are shared, not copied.
        Returns the request's whole block table. Raises if `can_allocate` is false.
        """
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            raise RuntimeError(f"out of KV blocks for request {request.request_id}")
        rid = request.request_id
        table = self.block_tables.setdefault(rid, [])
        hashes = self._block_hashes.setdefault(rid, [])
        for b in computed_blocks:
            self._take(b)
            table.append(b)
            hashes.append(self.blocks[b].block_hash)  # type: ignore[arg-type]
        num_total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        for _ in range(self.num_blocks_for(num_total) - len(table)):
            table.append(self._take_fresh())
        return table

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._evict(block)
        block.ref_count = 1
        return block_id

    def _evict(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) == block.block_id:  # type: ignore[arg-type]
            del self.cached[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None
        block.token_ids = ()
        self.stats.num_evicted_blocks += 1

    def free(self, request_id: str) -> None:
        """Release a request's blocks (finished, aborted or preempted). Idempotent."""
        table = self.block_tables.pop(request_id, [])
        self._block_hashes.pop(request_id, None)
        self._num_released.pop(request_id, None)
        for block_id in reversed(table):
            if block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
            assert block.ref_count >= 0, f"block {block_id} freed twice"

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Free the tail blocks a request no longer needs for `num_tokens` tokens (speculative
        rollback: blocks taken for rejected proposals). Returns how many were freed."""
        table = self.block_tables.get(request_id)
        if table is None:
            return 0
        keep = max(self.num_blocks_for(num_tokens), len(self._block_hashes.get(request_id, ())))
        num_freed = 0
        while len(table) > keep:
            block_id = table.pop()
            if block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
            num_freed += 1
        return num_freed

    def release_out_of_window(self, request: Request) -> int:
        """Sliding window: release the blocks no future query of the request can see (all keys before
        position num_computed_tokens - W + 1). Call after `cache_full_blocks`. Returns how many."""
        if self.sliding_window is None:
            return 0
        rid = request.request_id
        table = self.block_tables.get(rid)
        if table is None:
            return 0
        first_needed = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        start = self._num_released.get(rid, 0)
        num_freed = 0
        for i in range(start, min(first_needed, len(table))):
            block = self.blocks[table[i]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
            table[i] = NULL_BLOCK
            num_freed += 1
        self._num_released[rid] = max(start, min(first_needed, len(table)))
        return num_freed

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table minus released entries)."""
        return sum(1 for b in self.block_tables.get(request_id, ()) if b != NULL_BLOCK)

    def seq_block_ids(self, request_id: str) -> dict[str, tuple[int, ...]]:
        """The block tables a ScheduledSeq carries for this request (field name -> table)."""
        return {"block_ids": tuple(self.block_tables[request_id])}

    # ---- prefix registration ---------------------------------------------------------------
    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.block_tables.get(rid)
        if table is None:
            return
        hashes = self._block_hashes.setdefault(rid, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        if num_full <= len(hashes):
            return
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            hashes.append(h)
            parent = h
            if table[i] == NULL_BLOCK:
                continue
            block = self.blocks[table[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                block.token_ids = chunk
                self.cached[h] = block.block_id

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (e.g. after new weights); returns how many keys were dropped."""
        n = len(self.cached)
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        self.cached.clear()
        return n

    def check_invariants(self) -> None:
        """Assert the block accounting is consistent (used by tests after every step)."""
        refs = [0] * self.num_blocks
        for table in self.block_tables.values():
            for b in table:
                if b != NULL_BLOCK:
                    refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count wrong"
            assert (block.ref_count == 0) == (block.block_id in self.free_queue)
        assert self.num_used_blocks + self.num_free_blocks == self.num_blocks
        for h, b in self.cached.items():
            assert self.blocks[b].block_hash == h
