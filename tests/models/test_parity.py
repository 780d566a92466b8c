"""Our implementations vs HF transformers on tiny random checkpoints of every family (fp32)."""

from __future__ import annotations

import pytest
import torch

from firstlight.models.loader import load_model
from tests.models.conftest import FAMILIES
from tests.models.parity import (
    FP32_REL_TOL,
    chunked_prefill_error,
    hf_greedy,
    hf_reference,
    incremental_error,
    logit_errors,
    our_greedy,
)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_reference(tiny_dirs, family):
    ours, _ = load_model(tiny_dirs[family])
    ref = hf_reference(tiny_dirs[family])
    # 40 tokens: longer than the tiny sliding windows (8), so the window masks are exercised.
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    abs_err, rel_err = logit_errors(ours, ref, ids)
    assert rel_err <= FP32_REL_TOL, f"{family}: max abs {abs_err:.3g}, relative {rel_err:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_matches_reference(tiny_dirs, family):
    ours, tok = load_model(tiny_dirs[family])
    ref = hf_reference(tiny_dirs[family])
    prompt = tok.encode("The capital of France is")
    assert our_greedy(ours, prompt, 32) == hf_greedy(ref, prompt, 32)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decode_matches_full_forward(tiny_dirs, family):
    ours, _ = load_model(tiny_dirs[family])
    ids = torch.randint(0, ours.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    assert incremental_error(ours, ids, prefill=11) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_full_forward(tiny_dirs, family):
    ours, _ = load_model(tiny_dirs[family])
    ids = torch.randint(0, ours.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    assert chunked_prefill_error(ours, ids, chunk=7) < 1e-4


def test_parity_check_detects_a_wrong_weight(tiny_dirs):
    """The parity metric is not blind: a 1% change in one weight shows up well above tolerance."""
    ours, _ = load_model(tiny_dirs["llama"])
    ref = hf_reference(tiny_dirs["llama"])
    with torch.no_grad():
        ours.layers[1].mlp.down_proj.weight.mul_(1.01)
    ids = torch.randint(0, ours.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    _, rel_err = logit_errors(ours, ref, ids)
    assert rel_err > 10 * FP32_REL_TOL


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "granitemoehybrid", "nemotron_h"])
def test_bf16_close_to_fp32(tiny_dirs, family):
    ours32, _ = load_model(tiny_dirs[family])
    ours16, _ = load_model(tiny_dirs[family], dtype="bfloat16")
    ids = torch.randint(0, ours32.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ours32(ids), ours16(ids).float()
    assert (a - b).abs().max() / (a.max() - a.min()) < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
