"""Helpers that drive the scheduler with a fake model: no torch, no weights."""

from __future__ import annotations

from firstlight.core.batch import Batch
from firstlight.engine.kv_manager import KVCacheManager
from firstlight.engine.request import Request, SamplingParams
from firstlight.engine.scheduler import Scheduler, SchedulerConfig

VOCAB = 1000


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the whole sequence so far."""
    h = 17
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 256,
    prefix_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
    )
    return Scheduler(cfg, kv)


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **kw: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


def fake_execute(sched: Scheduler, batch: Batch) -> dict[str, list[int]]:
    """Sample one token for every request whose step reaches the end of its known tokens."""
    out: dict[str, list[int]] = {}
    for seq in batch.seqs:
        req = sched.requests[seq.request_id]
        end = seq.num_computed_tokens + seq.num_tokens
        if end == req.num_tokens:
            out[seq.request_id] = [fake_next_token(req.all_token_ids)]
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, check: bool = True) -> list[Batch]:
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        if check:
            sched.kv.check_invariants()
            check_batch(sched, batch)
        batches.append(batch)
        sched.update(batch, fake_execute(sched, batch))
        if check:
            sched.kv.check_invariants()
    return batches


def check_batch(sched: Scheduler, batch: Batch) -> None:
    cfg = sched.config
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    assert batch.num_seqs <= cfg.max_num_seqs
    for seq in batch.seqs:
        # the blocks cover every token the step writes
        assert len(seq.block_ids) * sched.kv.block_size >= seq.context_len
        assert len(set(seq.block_ids)) == len(seq.block_ids)
    # two running requests never share a block unless it is a cached (full, hashed) block
    owners: dict[int, str] = {}
    for seq in batch.seqs:
        for b in seq.block_ids:
            if b in owners:
                assert sched.kv.blocks[b].ref_count >= 2, f"block {b} shared but not ref-counted"
            owners[b] = seq.request_id


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = fake_next_token(toks)
        toks.append(t)
        out.append(t)
    return out
