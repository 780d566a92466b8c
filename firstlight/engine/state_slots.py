"""The hybrid cache manager: paged KV blocks for the attention layers, plus one fixed-size recurrent
state slot per running request for the linear-attention / SSM layers.

Pure bookkeeping, no torch (the runner owns the pools). A request takes a slot with its first block
allocation and gives it back when its blocks are freed (finished, aborted or preempted), so a
preempted request recomputes its state from scratch, exactly as it recomputes its KV. A chunked
prefill keeps its slot from chunk to chunk: the state after each chunk is where the next resumes.

Speculative decoding needs nothing here: the runner restores the state after the last accepted
token of a verify pass (`ModelRunner.keep_accepted_states`) in the request's own slot.

Prefix caching is off: a cached block would give the KV of a prefix but not the recurrent state
after it (that would need a state snapshot per block boundary, as vLLM's mamba "align" cache mode
keeps). Invariants: every slot is either free or held by exactly one request, and a request holds a
slot iff it holds a block table.
"""

from __future__ import annotations

from firstlight.engine.kv_manager import KVCacheManager
from firstlight.engine.request import Request

PREFIX_CACHING_OFF_REASON = (
    "prefix caching is off for this model: its linear-attention/SSM layers keep a recurrent state that "
    "the prefix cache does not snapshot at block boundaries"
)


class HybridCacheManager(KVCacheManager):
    """KV blocks (the base class) + recurrent state slots, taken and freed with the blocks."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, ...
        self.slot_of: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | tuple[int, ...] = ()
    ) -> bool:
        has_slot = request.request_id in self.slot_of
        return (has_slot or bool(self.free_slots)) and super().can_allocate(request, num_new_tokens, computed_blocks)

    def allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | tuple[int, ...] = ()
    ) -> list[int]:
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            raise RuntimeError(f"out of KV blocks or state slots for request {request.request_id}")
        table = super().allocate(request, num_new_tokens, computed_blocks)
        if request.request_id not in self.slot_of:
            self.slot_of[request.request_id] = self.free_slots.pop()
        return table

    def free(self, request_id: str) -> None:
        super().free(request_id)
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def check_invariants(self) -> None:
        super().check_invariants()
        held = list(self.slot_of.values())
        assert len(set(held)) == len(held), "a state slot is held by two requests"
        assert not set(held) & set(self.free_slots), "a held state slot is also free"
        assert len(held) + len(self.free_slots) == self.num_slots
        assert set(self.slot_of) == set(self.block_tables), "slot holders and block-table holders differ"
