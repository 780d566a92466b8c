"""Reports of a verification: the rich terminal summary, result.json + index.html with the plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from firstlight.core.report import environment_manifest, write_report


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
    console.print(
        f"logits (teacher-forced, {p['num_positions']} positions): top-1 {p['top1_agreement']:.4f}, "
        f"top-k overlap {p['topk_overlap']:.4f}, mean KL {max(p['mean_kl'], 0.0):.3g}, max |logprob err| {p['max_logprob_error']:.3g}",
        highlight=False,
    )
    if div is None:
        console.print("greedy: no divergence in the generated tokens", highlight=False)
    else:
        kind = "near-tie (reported, not failed)" if div["near_tie"] else "clear margin"
        console.print(f"greedy: first divergence at generated token {div['generated_index']} "
                      f"(ref margin {div['ref_margin']:.3g}: {kind})", highlight=False)
    if result.get("perplexity"):
        q = result["perplexity"]
        console.print(f"perplexity ({q['num_tokens']} tokens): reference {q['reference']:.4f}, "
                      f"target {q['target']:.4f}, ratio {q['ratio']:.5f}", highlight=False)
    c = result.get("culprit")
    if c:
        console.print(f"[bold red]culprit:[/] {c['op']} in {c['module']} (layer {c['layer']}) at {c['source']}\n"
                      f"    {c['code']}\n    isolated rel L2 {c['isolated']['rel_l2']:.3g}, "
                      f"max abs {c['isolated']['max_abs']:.3g}", highlight=False)
    elif result.get("first_failing"):
        console.print(f"[bold red]failing unit:[/] {result['first_failing']['unit']}: "
                      f"{result['first_failing'].get('note', '')}", highlight=False)
    for r in result["reasons"]:
        console.print(f"  - {r}", highlight=False)
    pred = (result.get("target_report") or {}).get("details", {}).get("predicted")
    if pred:
        console.print(f"predicted on {pred['chip']} (batch 1, {pred['prompt_len']}-token prompt): prefill "
                      f"{pred['prefill_ms']:.3g} ms, decode step {pred['decode_step_ms']:.3g} ms = "
                      f"{pred['decode_tokens_per_s']:.1f} tokens/s (weights {pred['weight_bytes'] / 1e6:.1f} MB"
                      + (f", host fallback {pred['host_fallback_ms_per_step']:.3g} ms/step" if pred.get(
                          "host_fallback_ms_per_step") else "") + ")", highlight=False)


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
    lines = [f"verdict: {result['verdict']}"] + [f"- {r}" for r in result["reasons"]]
    if result.get("culprit"):
        c = result["culprit"]
        lines.append(f"culprit: {c['op']} in {c['module']} at {c['source']}: {c['code']}")
    return write_report(out_dir, data, title=f"firstlight verify: {Path(result['model']).name} on {result['target']}",
                        figures={"layer_error": _figure(result)}, tables=tables, summary="\n".join(lines))
