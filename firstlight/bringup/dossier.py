"""The per-model dossier: `DIR/dossier.json` + `DIR/index.html` (plots as PNG next to it).

    firstlight dossier --model M --target emulate:CHIP [--overrides F] [--project h100,trn2] [--out DIR]
    (and at the end of every `firstlight bringup`, on the loop's final verify result)

Sections, each a key of dossier.json:
    verify         the verdict on every path verify ran (units, teacher-forced logits, perplexity,
                   and whatever serving paths / tables the verify result carries), culprit, reasons
    quality        perplexity ratio, mean / max KL, top-1 agreement, top-k overlap
    configuration  the final overrides file and the chip spec's predicted prefill / decode step /
                   tokens/s for it (targets/emulated_cost.py), and the commands that reproduce it
    engine         a measured run of our engine on this machine through `firstlight bench`
                   (dossier_engine.py), or why it was skipped or failed
    projections    the serving simulator on each `--project` chip at an SLO (dossier_project.py)
    environment    versions, machine, time

Bad input (unknown target, chip or model, missing overrides file, unwritable DIR) raises
`DossierError` (exit 2) before anything is written. Failures inside a section (verify cannot compile
the model, the engine does not start) are reported in that section; the dossier is still written.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from firstlight.bringup.dossier_engine import EngineRunSpec, measure_engine
from firstlight.bringup.dossier_project import DossierError, ProjectionSpec, check_chips
from firstlight.bringup.dossier_project import project as project_serving
from firstlight.errors import FirstlightError

__all__ = ["DossierError", "check_inputs", "write_dossier", "EngineRunSpec", "ProjectionSpec"]

# verify result keys the sections below read; anything else a newer verify adds is shown as is
_KNOWN = {"verdict", "model", "target", "dtype", "tokens", "prompt_len", "boundaries", "first_failing", "ops",
          "culprit", "parity", "perplexity", "target_report", "tolerance", "timings_s", "reasons",
          "isolated_reused", "reference_continuation", "paths", "tables", "long_range", "first_nonfinite"}


def check_inputs(out: Path, *, model: str, target: str, overrides_file: Path | None,
                 project: list[str]) -> tuple[Path, list[tuple[str, Any]]]:
    """(checkpoint dir, chips) or DossierError naming the bad input; writes nothing."""
    chips = check_chips(project)
    from firstlight.models.hub import resolve
    from firstlight.targets.registry import get_target

    if overrides_file is not None and not target.startswith("emulate:"):
        raise DossierError(f"--overrides applies to emulate:CHIP targets, not '{target}'")
    if overrides_file is not None and not Path(overrides_file).is_file():
        raise DossierError(f"--overrides {overrides_file}: no such file; give the overrides YAML (docs/EMULATION.md)")
    try:
        get_target(_target_spec(target, overrides_file))
    except FirstlightError as e:
        raise DossierError(f"--target {target}: {e}") from None
    try:
        path = resolve(model)
    except FirstlightError as e:
        raise DossierError(f"--model {model}: {e}") from None
    check_writable(out)
    return path, chips


def check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DossierError(f"--out {out} exists and is not a directory; give a directory")
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    try:
        if not probe.is_dir() or not os.access(probe, os.W_OK):
            raise OSError(f"{probe} is not a writable directory")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise DossierError(f"--out {out}: cannot write there ({e}); give a writable directory") from None


def _target_spec(target: str, overrides_file: Path | None) -> str:
    return f"{target},overrides={overrides_file}" if overrides_file is not None else target


def write_dossier(out: Path, *, model: str, target: str, overrides_file: Path | None,
                  verify_result: dict[str, Any] | None, project: list[str], bench: bool = True,
                  engine: EngineRunSpec | None = None, projection: ProjectionSpec | None = None,
                  verify_new_tokens: int = 16, verify_ppl_tokens: int = 256, threads: int = 0,
                  log: Callable[[str], None] | None = None) -> Path:
    """Write dossier.json and index.html (+ PNG plots) in `out`; returns the index.html path.

    `verify_result` is a verify result dict (VerifyResult.to_dict()); None runs verify here with the
    target and overrides. `project`: chip names for the sim projections. `bench=False` skips the
    measured engine run.
    """
    say = log or (lambda s: None)
    out = Path(out)
    path, chips = check_inputs(out, model=model, target=target, overrides_file=overrides_file, project=project)
    t0 = time.perf_counter()
    data: dict[str, Any] = {"kind": "firstlight.dossier", "version": 1, "model": _model_info(model, path),
                            "target": target, "sections_s": {}}
    source, error = "given (the bring-up loop's final verify)", None
    if verify_result is None:
        say(f"verify {path.name} on {target} ...")
        source = "run by the dossier"
        verify_result, error = _run_verify(model, target, overrides_file, verify_new_tokens, verify_ppl_tokens, threads)
    data["sections_s"]["verify"] = time.perf_counter() - t0
    data["verify"] = verify_section(verify_result, error, source)
    data["quality"] = quality_section(verify_result)
    data["configuration"] = configuration_section(model, target, overrides_file, verify_result, project)
    out.mkdir(parents=True, exist_ok=True)
    t1 = time.perf_counter()
    if bench:
        say(f"engine run: firstlight serve + firstlight bench on this machine ({os.cpu_count()} CPUs) ...")
        data["engine"] = measure_engine(path, out / "engine", engine)
    else:
        data["engine"] = {"status": "skipped", "reason": "--no-bench"}
    data["sections_s"]["engine"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    if chips:
        say(f"sim projections on {', '.join(project)} ...")
        data["projections"] = project_serving(path, chips, projection)
    else:
        data["projections"] = {"chips": [], "note": "no chips given (--project h100,trn2,...)"}
    data["sections_s"]["projections"] = time.perf_counter() - t2
    from firstlight.core.report import environment_manifest

    data["environment"] = environment_manifest()
    from firstlight.bringup.dossier_html import render_html, write_plots

    data["plots"] = write_plots(out, data)
    _atomic_write(out / "dossier.json", json.dumps(data, indent=1, default=str))
    html = out / "index.html"
    _atomic_write(html, render_html(data, out))
    return html


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is for reading
    os.replace(tmp, path)


def _model_info(model: str, path: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"name": model, "path": str(path)}
    try:
        cfg = json.loads((path / "config.json").read_text())
        info["model_type"] = cfg.get("model_type")
        info["architectures"] = cfg.get("architectures")
    except (OSError, ValueError):
        pass
    return info


def _run_verify(model: str, target: str, overrides_file: Path | None, new_tokens: int, ppl_tokens: int,
                threads: int) -> tuple[dict[str, Any] | None, str | None]:
    from firstlight.verify.cli import _run

    try:
        res = _run(model, target, "float32", None, new_tokens, ppl_tokens, None, threads, overrides=overrides_file)
    except FirstlightError as e:  # e.g. an op the chip's compiler does not lower: a finding, reported
        return None, str(e)
    return res.to_dict(), None


# ---- sections -----------------------------------------------------------------------------------
def verify_section(result: dict[str, Any] | None, error: str | None, source: str) -> dict[str, Any]:
    """The verdict and one row per path verify ran: {path, ok, detail}."""
    if result is None:
        return {"source": source, "verdict": "could not run", "error": error, "paths": [], "reasons": [error]}
    rows = []
    bnds = result.get("boundaries") or []
    bad = [b["name"] for b in bnds if not (b.get("isolated") or {}).get("ok", True)]
    rows.append({"path": "full forward: units in isolation", "ok": not bad,
                 "detail": f"{len(bnds)} boundaries, {len(bad)} over tolerance"
                           + (f" (first: {bad[0]})" if bad else "")})
    p = result.get("parity") or {}
    if p:
        rows.append({"path": "full forward: teacher-forced logits", "ok": bool(p.get("ok")),
                     "detail": "; ".join(p.get("reasons") or []) or
                     f"top-1 {_f(p.get('top1_agreement'))}, mean KL {_f(p.get('mean_kl'))} over "
                     f"{p.get('num_positions')} positions"})
    q = result.get("perplexity")
    if q:
        rows.append({"path": "perplexity (sliding windows)", "ok": bool(q.get("ok")),
                     "detail": f"ratio {_f(q.get('ratio'))} over {q.get('num_tokens')} tokens"})
    for name, rec in (result.get("paths") or {}).items():
        rows.append({"path": f"serving path: {name}", "ok": rec.get("ok") if isinstance(rec, dict) else None,
                     "detail": _path_detail(rec)})
    tables = result.get("tables") or []
    if tables:
        bad_t = [t for t in tables if not t.get("ok", True)]
        rows.append({"path": "tables (rotary, masks, scales)", "ok": not bad_t,
                     "detail": f"{len(tables)} compared" + (f"; first differing: {bad_t[0].get('name')}" if bad_t else "")})
    for key in sorted(set(result) - _KNOWN):  # sections a newer verify adds (decode, batch, ...)
        v = result[key]
        if isinstance(v, dict) and ("ok" in v or "verdict" in v):
            rows.append({"path": key, "ok": v.get("ok", v.get("verdict") == "match"), "detail": _short(v)})
    findings = {k: result[k] for k in ("long_range", "first_nonfinite") if result.get(k)}
    extra = {k: result[k] for k in sorted(set(result) - _KNOWN) if not (isinstance(result[k], dict)
                                                                       and ("ok" in result[k] or "verdict" in result[k]))}
    return {"source": source, "verdict": result.get("verdict"), "target": result.get("target"),
            "dtype": result.get("dtype"), "reasons": result.get("reasons") or [], "paths": rows,
            "culprit": result.get("culprit"), "first_failing": _first_failing(result.get("first_failing")),
            "findings": findings, "extra": {k: _short(v) for k, v in extra.items()},
            "boundaries": [_boundary(b) for b in bnds], "timings_s": result.get("timings_s")}


def _first_failing(ff: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if not ff else {k: v for k, v in ff.items() if k != "first_propagated_op"}


def _boundary(b: dict[str, Any]) -> dict[str, Any]:
    iso, prop = b.get("isolated") or {}, b.get("propagated") or {}
    return {"name": b["name"], "isolated_rel_l2": iso.get("rel_l2"), "isolated_ok": iso.get("ok"),
            "propagated_rel_l2": prop.get("rel_l2"), "propagated_ok": prop.get("ok")}


def _path_detail(rec: Any) -> str:
    if not isinstance(rec, dict):
        return _short(rec)
    parts = []
    steps = rec.get("steps")
    if isinstance(steps, list):
        parts.append(f"{len(steps)} steps")
        kls = [s.get("max_row_mean_kl") for s in steps if isinstance(s, dict) and s.get("max_row_mean_kl") is not None]
        if kls:
            parts.append(f"worst row mean KL {_f(max(kls))}")
    if rec.get("first_failing_step") is not None:
        parts.append(f"first failing step {rec['first_failing_step']}")
    kv = rec.get("kv_cache")
    if isinstance(kv, dict):
        parts.append(f"KV cache {'ok' if kv.get('ok') else 'differs'} (max rel L2 {_f(kv.get('max_rel_l2'))})")
    loc = rec.get("localization")
    if isinstance(loc, dict):
        parts.append(f"localized: step {loc.get('step')} ({loc.get('phase')}), unit {loc.get('failing_unit')}")
    return "; ".join(parts) or _short(rec)


def _short(v: Any, n: int = 300) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= n else s[:n] + " ..."


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, (int, float)) else str(v)


def quality_section(result: dict[str, Any] | None) -> dict[str, Any]:
    if result is None:
        return {"measured": False}
    p, q = result.get("parity") or {}, result.get("perplexity") or {}
    return {"measured": True,
            "perplexity_ratio": q.get("ratio"), "perplexity_reference": q.get("reference"),
            "perplexity_target": q.get("target"), "perplexity_tokens": q.get("num_tokens"),
            "mean_kl": p.get("mean_kl"), "max_kl": p.get("max_kl"), "top1_agreement": p.get("top1_agreement"),
            "topk_overlap": p.get("topk_overlap"), "num_positions": p.get("num_positions"),
            "units_over_tolerance": sum(1 for b in result.get("boundaries") or []
                                        if not (b.get("isolated") or {}).get("ok", True))}


def configuration_section(model: str, target: str, overrides_file: Path | None, result: dict[str, Any] | None,
                          project: list[str]) -> dict[str, Any]:
    import yaml

    text = Path(overrides_file).read_text() if overrides_file is not None else ""
    details = ((result or {}).get("target_report") or {}).get("details") or {}
    pred = details.get("predicted")
    ov = f" --overrides {shlex.quote(str(overrides_file))}" if overrides_file is not None else ""
    proj = f" --project {','.join(project)}" if project else ""
    return {"target": target, "overrides_file": str(overrides_file) if overrides_file is not None else None,
            "overrides": yaml.safe_load(text) if text else (details.get("overrides") or {}),
            "overrides_yaml": text,
            "predicted": pred,
            "predicted_note": None if pred else "no prediction: only emulate:CHIP targets that ran the model price it",
            "notes": ((result or {}).get("target_report") or {}).get("notes") or [],
            "verify_command": f"firstlight verify --model {shlex.quote(model)} --target {shlex.quote(target)}{ov}",
            "dossier_command": f"firstlight dossier --model {shlex.quote(model)} --target {shlex.quote(target)}{ov}{proj}"}
