"""Context parallelism (ring attention) and KV offload to host for 100K-1M token contexts."""

import pytest
from typer.testing import CliRunner

from firstlight.core.hardware import load_spec
from firstlight.sim.cli import app
from firstlight.sim.cost import CostModel
from firstlight.sim.model import load_model
from firstlight.sim.parallel import ParallelConfig, kv_bytes_per_token_per_device


def test_cp_splits_kv_and_attention_and_pays_the_ring():
    m, hw = load_model("llama-3.1-8b"), load_spec("h100")
    one = CostModel(m, hw, ParallelConfig(tp=2))
    two = CostModel(m, hw, ParallelConfig(tp=2, cp=2))
    assert kv_bytes_per_token_per_device(m, ParallelConfig(tp=2, cp=2)) == pytest.approx(
        kv_bytes_per_token_per_device(m, ParallelConfig(tp=2)) / 2)
    # a 8K chunk at 500K cached tokens is attention-bound: CP 2 nearly halves it (ring overlapped)
    chunk = [(8192, 500_000)]
    t1, t2 = one.step_time(8192, 1, 0, 0.0, chunk), two.step_time(8192, 1, 0, 0.0, chunk)
    assert 0.45 < t2 / t1 < 0.6
    # across the scale-out link (tp x cp beyond the 8-GPU NVLink domain) the KV ring dominates
    far = CostModel(m, hw, ParallelConfig(tp=8, cp=8))
    near = CostModel(m, hw, ParallelConfig(tp=8, cp=1))
    assert far.step_time(8192, 1, 0, 0.0, chunk) > near.step_time(8192, 1, 0, 0.0, chunk) / 8 * 1.5


def test_kv_offload_reads_the_host_part_over_the_host_link():
    m, hw = load_model("llama-3.1-8b"), load_spec("h100")
    on_device = CostModel(m, hw).step_time(1, 1, 1, 1_000_000.0)
    half = CostModel(m, hw, host_kv_fraction=0.5, host_kv_gbps=64).step_time(1, 1, 1, 1_000_000.0)
    kv_half_s = 0.5 * m.kv_bytes_per_token() * 1_000_000 / 64e9
    assert half > on_device and half == pytest.approx(on_device + kv_half_s, rel=0.25)


def test_cli_longctx_table():
    r = CliRunner().invoke(app, ["longctx", "--hw", "h100", "--model", "llama-3.1-8b", "--tp", "1", "--cp", "1,2",
                                 "--context", "1048576"])
    assert r.exit_code == 0, r.output
    assert "KV does not fit" in r.output  # 128 GB of KV on one 80 GB H100
    r = CliRunner().invoke(app, ["longctx", "--hw", "h100", "--model", "llama-3.1-8b", "--tp", "1", "--cp", "1",
                                 "--context", "1048576", "--kv-offload-gbps", "64"])
    assert r.exit_code == 0 and "%" in r.output and "KV does not fit" not in r.output
