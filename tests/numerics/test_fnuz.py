"""AMD's FNUZ fp8 variants (the MI300X emulated chip's matmul operands), checked against ml_dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from firstlight.numerics import get_format, quantize

ml_dtypes = pytest.importorskip("ml_dtypes")


@pytest.mark.parametrize("name, np_dtype, max_normal", [("fp8_e4m3fnuz", "float8_e4m3fnuz", 240.0),
                                                        ("fp8_e5m2fnuz", "float8_e5m2fnuz", 57344.0)])
def test_fnuz_values_match_ml_dtypes(name, np_dtype, max_normal):
    f = get_format(name)
    assert f.max_normal == max_normal and not f.has_inf
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * s for s in (1e-3, 1.0, 100.0, 1e4)])
    ref = np.clip(x.numpy(), -max_normal, max_normal).astype(getattr(ml_dtypes, np_dtype)).astype(np.float32)
    assert torch.equal(quantize(x, name), torch.from_numpy(ref))
    # saturating, and the smallest subnormal is 2^(1 - bias - m)
    assert quantize(torch.tensor([1e9, -1e9]), name).tolist() == [max_normal, -max_normal]
    tiny = 2.0 ** (1 - f.bias - f.man_bits)
    assert quantize(torch.tensor([tiny, tiny * 0.49]), name).tolist() == [tiny, 0.0]
