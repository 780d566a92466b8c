"""Reports of a verification: the rich terminal summary, result.json + index.html with the plot, summary.md.

Every number may be None (a non-finite value made strict JSON, see nonfinite.py): nothing here
formats a number without `_fmt`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from firstlight.core.report import environment_manifest, write_report
from firstlight.verify.nonfinite import json_safe


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def print_summary(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 130)
    ok = result["verdict"] == "match"
    colour = "green" if ok else "red"
    console.print(f"[bold {colour}]{result['verdict'].upper()}[/] {result['model']} on target "
                  f"{result['target']} ({result['dtype']})", highlight=False)
    table = Table(title="unit outputs (isolated: target unit on reference input)", show_lines=False)
    for col in ("boundary", "rel L2 iso", "max abs iso", "frac beyond", "max ULP", "PCC", "rel L2 prop", "ok"):
        table.add_column(col, justify="right" if col != "boundary" else "left", no_wrap=True)
    rows = [b for b in result["boundaries"] if "isolated" in b]
    if len(rows) > 14:  # long models: the ends, plus every failing row
        keep = {r["name"] for r in rows[:5] + rows[-4:]} | {r["name"] for r in rows if not r["isolated"]["ok"]}
        rows = [r for r in rows if r["name"] in keep]
    for b in rows:
        iso, prop = b["isolated"], b.get("propagated", {})
        table.add_row(b["name"], _fmt(iso["rel_l2"]), _fmt(iso["max_abs"]), _fmt(iso["frac_beyond"]),
                      _fmt(iso["max_ulp"]), _fmt(iso["pcc"]), _fmt(prop.get("rel_l2")),
                      "[green]ok[/]" if iso["ok"] else "[red]FAIL[/]")
    console.print(table)
    cont = result.get("reference_continuation") or {}
    if cont.get("new_tokens"):
        console.print(f"reference continuation: {cont['new_tokens']} greedy tokens, {cont['source']} "
                      f"(cache: {cont['cache']})", highlight=False)
    p = result["parity"]
    div = p["first_divergence"]
    kl = p["mean_kl"]
    console.print(
        f"logits (teacher-forced, {p['num_positions']} positions): top-1 {_fmt(p['top1_agreement'])}, "
        f"top-k overlap {_fmt(p['topk_overlap'])}, mean KL {_fmt(max(kl, 0.0) if kl is not None else None)}, "
        f"max |logprob err| {_fmt(p['max_logprob_error'])}",
        highlight=False,
    )
    if div is None:
        console.print("greedy: no divergence in the generated tokens", highlight=False)
    else:
        kind = "near-tie (reported, not failed)" if div["near_tie"] else "clear margin"
        console.print(f"greedy: first divergence at generated token {div['generated_index']} "
                      f"(ref margin {_fmt(div['ref_margin'])}: {kind})", highlight=False)
    if result.get("perplexity"):
        q = result["perplexity"]
        console.print(f"perplexity ({q['num_tokens']} tokens, target's logits unit): reference {_fmt(q['reference'])}, "
                      f"target {_fmt(q['target'])}, ratio {_fmt(q['ratio'])} (allowed "
                      f"{_fmt(q['allowed_ratio'][0])}..{_fmt(q['allowed_ratio'][1])}), mean KL {_fmt(q['mean_kl'])}",
                      highlight=False)
    for line in serving_lines(result):
        console.print(line, highlight=False)
    c = result.get("culprit")
    ff = result.get("first_failing") or {}
    where = f" ({ff['path']} path, step {ff['step']}, {ff.get('phase', '')})" if ff.get("path") and "step" in ff else ""
    if c:
        iso = c["isolated"]
        console.print(f"[bold red]culprit{where}:[/] {c['op']} in {c['module']} (layer {c['layer']}) at {c['source']}\n"
                      f"    {c['code']}\n    isolated rel L2 {_fmt(iso['rel_l2'])}, "
                      f"max abs {_fmt(iso['max_abs'])}", highlight=False)
    elif ff:
        console.print(f"[bold red]failing unit{where}:[/] {ff.get('unit')}"
                      f"{' ' + ff['table'] if ff.get('table') else ''}: {ff.get('note', '')}", highlight=False)
    nf = result.get("first_nonfinite")
    if nf:
        op = f", op {nf['op']} in {nf.get('module')} at {nf.get('source')}" if nf.get("op") else ""
        console.print(f"[bold red]first non-finite value:[/] {nf['where']}{op}", highlight=False)
    for r in result["reasons"]:
        console.print(f"  - {r}", highlight=False)
    pred = (result.get("target_report") or {}).get("details", {}).get("predicted")
    if pred:
        console.print(f"predicted on {pred['chip']} (batch 1, {pred['prompt_len']}-token prompt): prefill "
                      f"{pred['prefill_ms']:.3g} ms, decode step {pred['decode_step_ms']:.3g} ms = "
                      f"{pred['decode_tokens_per_s']:.1f} tokens/s (weights {pred['weight_bytes'] / 1e6:.1f} MB"
                      + (f", host fallback {pred['host_fallback_ms_per_step']:.3g} ms/step" if pred.get(
                          "host_fallback_ms_per_step") else "") + ")", highlight=False)


def serving_lines(result: dict[str, Any]) -> list[str]:
    """One line per serving path, the tables and a long-range finding (terminal and markdown)."""
    lines = []
    for name, rec in (result.get("paths") or {}).items():
        steps = rec["steps"]
        worst = max((s["max_row_mean_kl"] for s in steps if s["max_row_mean_kl"] is not None), default=None)
        state = "ok" if rec["ok"] else "FAIL"
        carried = f", recurrent state max rel L2 {_fmt(rec['state']['max_rel_l2'])}" if rec.get("state") else ""
        lines.append(f"{name} path ({len(steps)} steps, block {rec['block_size']}): {state}; worst row mean KL "
                     f"{_fmt(worst)}, K/V cache max rel L2 {_fmt(rec['kv_cache']['max_rel_l2'])}{carried}")
        loc = rec.get("localization")
        if loc:
            lines.append(f"    first failing step {loc['step']} ({loc['phase']}, positions {loc['positions']}): "
                         f"unit {loc.get('failing_unit')}")
    bad = [t for t in result.get("tables") or [] if not t["ok"]]
    if result.get("tables"):
        lines.append(f"tables (rotary, masks, scales): {len(result['tables'])} compared, "
                     + ("all match the reference's" if not bad else
                        f"{len(bad)} differ; first {bad[0]['name']} ({bad[0]['path']}) from position "
                        f"{bad[0].get('first_bad_position')}"))
    lr = result.get("long_range")
    if lr:
        lines.append(f"long range: divergence starts at position {lr['first_position']} of window {lr['window']}; "
                     f"first shown by {lr['first_unit']} ({lr['mode']})")
    return lines


def markdown_summary(result: dict[str, Any]) -> str:
    """summary.md: verdict, reasons, culprit, serving paths, first non-finite (no numbers formatted as NaN)."""
    out = [f"# verify: {Path(result['model']).name} on {result['target']} ({result['dtype']})", "",
           f"**{result['verdict'].upper()}**", ""]
    out += [f"- {r}" for r in result["reasons"]]
    c, ff, nf = result.get("culprit"), result.get("first_failing"), result.get("first_nonfinite")
    if c:
        out += ["", f"culprit: `{c['op']}` in `{c['module']}` at `{c['source']}`: `{c['code']}`"]
    elif ff:
        out += ["", f"first failing: {ff.get('unit')} {ff.get('table') or ''} {ff.get('note') or ''}".rstrip()]
    if nf:
        out += ["", f"first non-finite value: {nf['where']}" + (f", op `{nf['op']}` at `{nf.get('source')}`"
                                                              if nf.get("op") else "")]
    lines = serving_lines(result)
    if lines:
        out += ["", "## serving paths, tables, long range", ""] + [f"    {line}" for line in lines]
    return "\n".join(out) + "\n"


def _figure(result: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [b for b in result["boundaries"] if b["name"].count(".") == 1 and b["name"].startswith("layers.")]
    xs = [int(b["name"].split(".")[1]) for b in layers]
    fig, ax = plt.subplots(figsize=(8, 4))
    for mode, style in (("isolated", "o-"), ("propagated", "s--")):
        ys = [max(b.get(mode, {}).get("rel_l2") or 0.0, 1e-12) for b in layers]
        if any(mode in b for b in layers):
            ax.semilogy(xs, ys, style, label=f"{mode} rel L2")
    ax.axhline(result["tolerance"]["tensor"]["max_rel_l2"], color="red", lw=0.8, label="tolerance (max rel L2)")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 error vs reference")
    ax.set_title(f"{Path(result['model']).name} on {result['target']} ({result['dtype']})")
    ax.legend()
    return fig


def write_verify_report(out_dir: str | Path, result: dict[str, Any], seed: int) -> Path:
    """result.json (strict JSON: non-finite numbers are null), index.html with the plot, summary.md."""
    result = json_safe(result)
    data = dict(result)
    data["environment"] = environment_manifest(seed=seed)
    rows = [{"boundary": b["name"], **{f"iso_{k}": v for k, v in b.get("isolated", {}).items() if k != "numel"},
             "prop_rel_l2": b.get("propagated", {}).get("rel_l2")} for b in result["boundaries"]]
    tables = {"boundaries": rows}
    if result.get("ops"):
        tables["ops of the failing unit (isolated vs propagated)"] = [
            {"#": o["index"], "op": o["op"], "module": o["module"], "source": o["source"],
             "iso rel L2": o["isolated"]["rel_l2"], "iso ok": o["isolated"]["ok"],
             "prop rel L2": o["propagated"]["rel_l2"]} for o in result["ops"]]
    for name, rec in (result.get("paths") or {}).items():
        tables[f"serving path: {name}"] = [
            {"step": st["step"], "phase": st["phase"], "shape": st["shape"], "positions": st["positions"],
             "mean KL": st["mean_kl"], "max row mean KL": st["max_row_mean_kl"], "top-1": st["top1_agreement"],
             "clear flips": st["num_clear_flips"], "non-finite rows": st["nonfinite_rows"],
             "tables ok": st["tables_ok"], "ok": st["ok"]} for st in rec["steps"]]
    bad_tables = [t for t in result.get("tables") or [] if not t["ok"]]
    if bad_tables:
        tables["tables that differ from the reference's"] = [
            {"table": t["name"], "path": t["path"], "first bad position": t.get("first_bad_position"),
             "rel L2": t.get("rel_l2")} for t in bad_tables]
    lines = [f"verdict: {result['verdict']}"] + [f"- {r}" for r in result["reasons"]]
    if result.get("culprit"):
        c = result["culprit"]
        lines.append(f"culprit: {c['op']} in {c['module']} at {c['source']}: {c['code']}")
    if result.get("first_nonfinite"):
        lines.append(f"first non-finite value: {result['first_nonfinite']['where']}")
    lines += serving_lines(result)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(markdown_summary(result))
    return write_report(out_dir, data, title=f"firstlight verify: {Path(result['model']).name} on {result['target']}",
                        figures={"layer_error": _figure(result)}, tables=tables, summary="\n".join(lines))
