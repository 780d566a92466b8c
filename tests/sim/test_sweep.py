import json

import pytest
from typer.testing import CliRunner

from firstlight.errors import FirstlightError
from firstlight.sim.cli import app
from firstlight.sim.sweep import (
    SweepError,
    SweepSpec,
    best_meeting_slo,
    grid,
    pareto_front,
    parse_slo,
    run_sweep,
)


def test_pareto_front_and_best():
    rows = [
        {"fits": True, "tpot_p90_s": 0.01, "usd_per_1m_output_tokens": 9.0, "meets_slo": True, "num_devices": 8},
        {"fits": True, "tpot_p90_s": 0.02, "usd_per_1m_output_tokens": 4.0, "meets_slo": True, "num_devices": 4},
        {"fits": True, "tpot_p90_s": 0.03, "usd_per_1m_output_tokens": 5.0, "meets_slo": True, "num_devices": 2},
        {"fits": True, "tpot_p90_s": 0.2, "usd_per_1m_output_tokens": 1.0, "meets_slo": False, "num_devices": 1},
        {"fits": False},
    ]
    front = pareto_front(rows)
    assert [r["usd_per_1m_output_tokens"] for r in front] == [9.0, 4.0, 1.0]  # 5.0 is dominated by 4.0
    assert best_meeting_slo(rows)["usd_per_1m_output_tokens"] == 4.0


def test_sweep_marks_what_does_not_fit_and_parallel_equals_serial():
    points = grid(["h100", "mi300x"], [1, 2], [1], [4.0])
    spec = SweepSpec("llama-3.1-70b", num_requests=60, prompt_len=256, output_len=32)
    done: list[int] = []
    serial = run_sweep(points, spec, workers=1, advance=done.append)
    assert done == [1] * len(points)  # the progress hook: one call per finished point
    by = {(r["hw"], r["tp"]): r for r in serial}
    assert not by[("h100", 1)]["fits"] and "does not fit" in by[("h100", 1)]["reason"]
    assert by[("mi300x", 1)]["fits"]  # 192 GB holds 70B bf16
    assert by[("h100", 2)]["fits"] and by[("h100", 2)]["ttft_p90_s"] > 0
    done.clear()
    parallel = run_sweep(points, spec, workers=2, advance=done.append)
    assert sum(done) == len(points)
    for a, b in zip(serial, parallel, strict=True):
        assert {k: v for k, v in a.items() if k != "sim_wall_s"} == {k: v for k, v in b.items() if k != "sim_wall_s"}


def test_parse_errors_and_missing_ray(monkeypatch):
    assert parse_slo("ttft=1500,tpot=50") == pytest.approx((1.5, 0.05))  # ms, like `bench --slo`
    assert parse_slo("ttft=1.5s,tpot=50ms") == pytest.approx((1.5, 0.05))
    assert parse_slo("tpot:40") == pytest.approx((2.0, 0.04))  # the default TTFT stays; ':' works as '='
    with pytest.raises(FirstlightError, match="keys ttft, tpot"):  # e2e is bench's; the simulator has no e2e SLO
        parse_slo("latency=3")
    with pytest.raises(FirstlightError, match="empty item"):
        parse_slo("ttft=2000,")
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray":
            raise ImportError("no ray")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(SweepError, match="optional dependency ray"):
        run_sweep(grid(["h100"], [8], [1], [1.0]), SweepSpec("llama-3.1-8b", num_requests=5), use_ray=True)


def test_cli_sweep_writes_report(tmp_path):
    r = CliRunner().invoke(app, ["sweep", "--model", "llama-3.1-8b", "--hw", "h100,a100", "--tp", "1,2",
                                 "--rate", "4", "--num-requests", "60", "--slo", "ttft=2s,tpot=50ms",
                                 "--workers", "1", "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert "best meeting" in r.output
    res = json.loads((tmp_path / "rep" / "result.json").read_text())
    assert len(res["rows"]) == 4 and res["best"]["meets_slo"]
    assert (tmp_path / "rep" / "pareto_cost_vs_tpot.png").is_file()


@pytest.mark.slow
def test_ray_sweep_equals_local_sweep():
    """Starts a local Ray cluster (2 CPUs), runs a small sweep on it, compares with local processes."""
    pytest.importorskip("ray", reason="the optional extra firstlight[ray] is not installed")
    points = grid(["h100", "mi300x"], [1, 2], [1], [2.0, 8.0])
    spec = SweepSpec("llama-3.1-8b", num_requests=40, prompt_len=256, output_len=32)
    local = run_sweep(points, spec, workers=1)
    done: list[int] = []
    on_ray = run_sweep(points, spec, workers=2, use_ray=True, advance=done.append)
    assert sum(done) == len(points)
    strip = [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in local]
    assert [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in on_ray] == strip
    assert all(r["fits"] for r in local)
