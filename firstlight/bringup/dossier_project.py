"""Sim projections for the dossier: serving the model on each chip the user lists, at an SLO.

For every chip, the serving simulator (sim/serve.py) runs Poisson arrivals of fixed-length requests
on one replica, at the smallest tensor-parallel degree (1, 2, 4, 8) whose memory plan holds the
weights. The rate is searched for the highest one the replica *sustains* within the SLO (p90 TTFT and
p90 TPOT under their limits): it doubles from `min_rate` until the SLO breaks, then bisects
`num_bisect` times. Each run lasts until steady state: arrivals span at least `window_s` and at least
3 median request lifetimes (the same rule as `sim compare`), so a rate above capacity cannot hide in
a short burst. At the rate found: output tokens/s = rate x output length (every arrival is served
within the SLO), TTFT / TPOT p50 / p90 / p99, and $ per 1M output tokens = devices x $/hour /
(output tokens/s x 3600) x 1e6.

A chip that misses the SLO even at `min_rate` gets its figures at that rate and `meets_slo: false`; a
chip the model does not fit on at tp <= 8 gets the simulator's reason. Chip names are checked
(`check_chips`) before anything runs or is written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from firstlight.errors import FirstlightError


class DossierError(FirstlightError):
    """Bad dossier input (unknown chip, target, model, unwritable out): nothing is written."""

    exit_code = 2


METHOD = ("highest Poisson request rate one replica sustains with p90 TTFT and p90 TPOT within the SLO "
          "(arrivals >= window_s and >= 3 median request lifetimes); output tok/s = rate x output length; "
          "$/1M output tokens = devices x $/hour / (output tok/s x 3600) x 1e6 (firstlight/bringup/dossier_project.py)")


@dataclass(frozen=True)
class ProjectionSpec:
    num_requests: int = 64  # at least this many requests per run
    window_s: float = 20.0  # ... and at least this many seconds of arrivals (more if 3 lifetimes need it)
    max_requests: int = 20000
    prompt_len: int = 512
    output_len: int = 128
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.05
    weight_dtype: str = "bf16"  # how the model would be served there (sim's compute dtype follows it)
    min_rate: float = 0.5  # requests/s
    max_rate: float = 4096.0
    num_bisect: int = 4
    tp_choices: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0


def parse_slo(text: str) -> tuple[float, float]:
    """`ttft=1,tpot=0.05` (seconds; `ms` suffix allowed) -> (ttft_s, tpot_s)."""
    vals = {"ttft": 1.0, "tpot": 0.05}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, raw = part.partition("=")
        key, raw = key.strip().lower(), raw.strip().lower()
        if not sep or key not in vals:
            raise DossierError(f"--slo item '{part}': expected ttft=SECONDS or tpot=SECONDS, e.g. 'ttft=1,tpot=0.05'")
        scale = 1e-3 if raw.endswith("ms") else 1.0
        try:
            v = float(raw.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise DossierError(f"--slo item '{part}': '{raw}' is not a number of seconds (or '50ms')") from None
        if not v > 0:
            raise DossierError(f"--slo {key} must be > 0, got '{raw}'")
        vals[key] = v
    return vals["ttft"], vals["tpot"]


def check_chips(names: list[str]) -> list[tuple[str, Any]]:
    """(name, HardwareSpec) for each chip; DossierError naming the first unknown one."""
    from firstlight.core.hardware import HardwareSpecError, builtin_spec_names, load_spec

    out = []
    for name in names:
        try:
            out.append((name, load_spec(name)))
        except HardwareSpecError as e:
            raise DossierError(f"--project chip '{name}': {e}. Known chips: {', '.join(builtin_spec_names())} "
                               "(or aliases such as h100, trn2, mi300)") from None
    return out


def project(model_dir: str | Path, chips: list[tuple[str, Any]], spec: ProjectionSpec | None = None) -> dict[str, Any]:
    """One row per chip (see the module doc); never raises for a chip that cannot serve the model."""
    from firstlight.sim.model import load_model

    spec = spec or ProjectionSpec()
    try:
        model = load_model(model_dir, weight_dtype=spec.weight_dtype, kv_dtype=spec.weight_dtype)
    except FirstlightError as e:
        return {"spec": asdict(spec), "error": f"the simulator cannot describe the model: {e}", "chips": []}
    rows = [_project_chip(model, name, hw, spec) for name, hw in chips]
    return {"spec": asdict(spec), "model": model.name, "num_params": model.num_params(), "chips": rows,
            "method": METHOD}


def _project_chip(model: Any, name: str, hw: Any, spec: ProjectionSpec) -> dict[str, Any]:
    row: dict[str, Any] = {"chip": name, "hardware": hw.name, "price_per_hour_usd": hw.price_per_hour_usd}
    reason = ""
    for tp in spec.tp_choices:
        try:
            first = _simulate(model, hw, spec, tp, spec.min_rate)
        except FirstlightError as e:
            reason = str(e)
            continue
        return row | _search(model, hw, spec, tp, first)
    return row | {"fits": False, "reason": reason}


def _simulate(model: Any, hw: Any, spec: ProjectionSpec, tp: int, rate: float) -> dict[str, Any]:
    from firstlight.sim.serve import ServeConfig, run_serve
    from firstlight.sim.workload import make_workload

    cfg = ServeConfig(tp=tp, slo_ttft_s=spec.slo_ttft_s, slo_tpot_s=spec.slo_tpot_s)
    n = int(min(max(spec.num_requests, rate * spec.window_s), spec.max_requests))
    while True:  # steady state: rerun with more arrivals until they span 3 median request lifetimes
        wl = make_workload(n, rate, spec.prompt_len, spec.output_len, seed=spec.seed)
        result, _ = run_serve(model, hw, wl, cfg)
        want = int(rate * 3 * result["e2e_s"].get("p50", 0.0)) + 1
        if n >= want or n >= spec.max_requests:
            return {"rate": rate, "num_requests": n, **result}
        n = min(want, spec.max_requests)


def _meets(r: dict[str, Any], spec: ProjectionSpec) -> bool:
    return r["ttft_s"].get("p90", float("inf")) <= spec.slo_ttft_s and r["tpot_s"].get("p90", 0.0) <= spec.slo_tpot_s


def _search(model: Any, hw: Any, spec: ProjectionSpec, tp: int, first: dict[str, Any]) -> dict[str, Any]:
    num_sims = 1
    if not _meets(first, spec):
        return _row(first, tp, False, num_sims, spec, hw)
    good, bad = first, None
    while bad is None and good["rate"] * 2 <= spec.max_rate:
        r = _simulate(model, hw, spec, tp, good["rate"] * 2)
        num_sims += 1
        good, bad = (r, None) if _meets(r, spec) else (good, r)
    for _ in range(spec.num_bisect if bad is not None else 0):
        r = _simulate(model, hw, spec, tp, (good["rate"] + bad["rate"]) / 2)
        num_sims += 1
        good, bad = (r, bad) if _meets(r, spec) else (good, r)
    return _row(good, tp, True, num_sims, spec, hw, None if bad is None else bad["rate"])


def _row(r: dict[str, Any], tp: int, meets: bool, num_sims: int, spec: ProjectionSpec, hw: Any,
         first_failing_rate: float | None = None) -> dict[str, Any]:
    ttft, tpot = r["ttft_s"], r["tpot_s"]
    # sustained within the SLO: every arrival is served, so the output rate is the offered one; past the
    # SLO (meets=False) the simulated throughput is what the replica managed at min_rate
    tok_s = r["rate"] * spec.output_len if meets else r["throughput"]["output_tokens_per_s"]
    devices = r["num_devices"]
    price = hw.price_per_hour_usd
    return {
        "fits": True, "reason": "", "tp": tp, "num_devices": devices, "meets_slo": meets,
        "rate_req_per_s": r["rate"], "first_failing_rate_req_per_s": first_failing_rate,
        "output_tokens_per_s": tok_s, "output_tokens_per_s_per_device": tok_s / devices,
        "ttft_p50_s": ttft.get("p50"), "ttft_p90_s": ttft.get("p90"), "ttft_p99_s": ttft.get("p99"),
        "tpot_p50_s": tpot.get("p50"), "tpot_p90_s": tpot.get("p90"), "tpot_p99_s": tpot.get("p99"),
        "usd_per_1m_output_tokens": None if price is None or tok_s <= 0 else price * devices / (tok_s * 3600) * 1e6,
        "num_requests_simulated": r["num_requests"], "num_simulations": num_sims,
    }
