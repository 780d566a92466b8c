"""Compiled decode: bucketed shapes, a bounded number of graphs, the same tokens as eager."""

from __future__ import annotations

import torch

from firstlight.core.batch import ScheduledSeq
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.engine.runner import ModelRunner, batch_buckets, bucket_up, key_buckets


def test_buckets() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert key_buckets(16, 16) == (16,)
    assert key_buckets(512, 16) == (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert key_buckets(100, 4)[-1] == 100  # capped at the blocks that hold max_keys
    for n in range(1, 101):
        b = bucket_up(n, key_buckets(100, 4))
        assert n <= b and b % 4 == 0 and (b <= 8 or b <= 1.5 * n + 4)  # at most ~1/3 padding past 2 blocks


def test_padding_rows_and_keys_do_not_change_real_rows(tiny) -> None:
    """Eager forward over a padded (B, L) bucket = unpadded forward for the real rows; padding rows
    write only the scratch slot."""
    model, _ = tiny
    runner = ModelRunner(model, num_blocks=16, block_size=4, max_num_seqs=8, max_model_len=64)
    g = torch.Generator().manual_seed(0)
    for pool in runner.k_pools + runner.v_pools:
        pool.normal_(generator=g)
    seqs = [ScheduledSeq("a", 1, 6, 4, (0, 1)), ScheduledSeq("b", 1, 9, 4, (2, 3, 4))]
    ids = torch.tensor([[5], [7]])
    pos = torch.tensor([[6], [9]])
    with torch.inference_mode():
        k_before = [p.clone() for p in runner.k_pools]
        ref = model.forward_hidden(ids, pos, runner._make_cache(seqs, pos))  # [2, 1, E]
        k_ref = [p.clone() for p in runner.k_pools]
        for p, b in zip(runner.k_pools, k_before, strict=True):
            p.copy_(b)
        ids_p = torch.cat([ids, torch.zeros(2, 1, dtype=torch.long)])
        pos_p = torch.cat([pos, torch.full((2, 1), -1)])
        padded = model.forward_hidden(ids_p, pos_p, runner._make_cache(seqs, pos_p, num_keys=24))
    torch.testing.assert_close(padded[:2], ref, rtol=1e-5, atol=1e-5)
    written = [6, 17]  # a: position 6 in block 1; b: position 9 in block 4 (block size 4)
    untouched = [i for i in range(runner.scratch_slot) if i not in written]
    for p, r, b in zip(runner.k_pools, k_ref, k_before, strict=True):
        assert torch.equal(p[untouched], b[untouched])  # padding rows wrote no real slot
        torch.testing.assert_close(p[written], r[written], rtol=1e-5, atol=1e-5)
        assert not torch.equal(p[runner.scratch_slot], b[runner.scratch_slot])  # they wrote the scratch slot


def test_compiled_decode_matches_eager_with_bounded_graphs(tiny) -> None:
    model, tok = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 380, (int(n),), generator=g).tolist() for n in torch.randint(2, 30, (12,), generator=g)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=0)
    results = {}
    for compiled in (False, True):
        cfg = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8, max_model_len=128, compile_decode=compiled)
        engine = LLMEngine(model, tok, cfg)
        done: dict[str, object] = {}
        for step in range(1000):  # one arrival every 3 steps: batch sizes and contexts sweep the buckets
            if step % 3 == 0 and step // 3 < len(prompts):
                engine.add_request(prompts[step // 3], params, request_id=f"r{step // 3}")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if len(done) == len(prompts):
                break
        results[compiled] = (done, engine.runner)
    (eager, _), (comp, runner) = results[False], results[True]
    for rid, out in eager.items():
        assert comp[rid].output_token_ids == out.output_token_ids, rid
        lp_e = torch.tensor([lp.logprob for lp in out.logprobs])
        lp_c = torch.tensor([lp.logprob for lp in comp[rid].logprobs])
        torch.testing.assert_close(lp_c, lp_e, rtol=1e-4, atol=1e-4)
    shapes = runner.decode_shapes
    assert {b for b, _ in shapes} >= {1, 2, 4, 8} and len({k for _, k in shapes}) >= 4
    assert all(b in runner.batch_buckets and k in runner.key_buckets for b, k in shapes)
    # many bucket pairs ran, few graphs were built: symbolic shapes share them, the buckets bound them
    assert 1 <= runner.num_decode_compiles <= 4 < len(shapes)
    assert runner.num_decode_compiles <= runner.max_decode_graphs
