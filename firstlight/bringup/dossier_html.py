"""The dossier's page and plots: index.html (one section per dossier.json key) and PNGs next to it."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_CSS = ("body{font-family:sans-serif;margin:2em;max-width:75em}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%;text-align:left}img{max-width:100%}"
        ".ok{color:#070}.bad{color:#b00;font-weight:bold}pre{background:#f6f6f6;padding:.5em;overflow-x:auto}")


def write_plots(out: Path, data: dict[str, Any]) -> list[str]:
    """PNG files written next to index.html; their names, in page order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for name, make in (("dossier-verify.png", _verify_figure), ("dossier-engine.png", _engine_figure),
                       ("dossier-projections.png", _projection_figure)):
        fig = make(data, plt)
        if fig is None:
            continue
        fig.savefig(out / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def _verify_figure(data: dict[str, Any], plt: Any) -> Any:
    rows = [b for b in data["verify"].get("boundaries", []) if b.get("isolated_rel_l2") is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.2))
    x = range(len(rows))
    for key, label in (("isolated_rel_l2", "isolated (reference input)"), ("propagated_rel_l2", "propagated")):
        ax.plot(x, [max(r.get(key) or 0.0, 1e-12) for r in rows], marker="o", ms=3, label=label)
    bad = [i for i, r in enumerate(rows) if r.get("isolated_ok") is False]
    if bad:
        ax.scatter(bad, [max(rows[i]["isolated_rel_l2"], 1e-12) for i in bad], color="red", zorder=3,
                   label="over tolerance")
    ax.set_yscale("log")
    ax.set_xticks(list(x), [r["name"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("relative L2 error")
    ax.set_title(f"verify: error per boundary on {data['target']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def _engine_figure(data: dict[str, Any], plt: Any) -> Any:
    e = data.get("engine") or {}
    if e.get("status") != "ok":
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 2.8))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        st = e.get(key) or {}
        stats = [s for s in ("median", "p90", "p99") if st.get(s) is not None]
        ax.bar(stats, [st[s] for s in stats], color="#4878a8")
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    m = e.get("machine") or {}
    fig.suptitle(f"our engine (fp32) on this machine: {m.get('num_cpus')} CPUs, {m.get('server_torch_threads')} "
                 f"torch threads, {e.get('output_tokens_per_s') or 0:.1f} output tok/s", fontsize=9)
    fig.tight_layout()
    return fig


def _projection_figure(data: dict[str, Any], plt: Any) -> Any:
    rows = [r for r in (data.get("projections") or {}).get("chips", []) if r.get("fits")]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    labels = [r["chip"] + ("" if r["meets_slo"] else "\n(misses SLO)") for r in rows]
    colors = ["#4878a8" if r["meets_slo"] else "#c44e52" for r in rows]
    axes[0].bar(labels, [r["output_tokens_per_s_per_device"] for r in rows], color=colors)
    axes[0].set_ylabel("output tok/s per device")
    axes[0].set_title("throughput at the SLO")
    cost = [r.get("usd_per_1m_output_tokens") or 0.0 for r in rows]
    axes[1].bar(labels, cost, color=colors)
    axes[1].set_ylabel("$ per 1M output tokens")
    axes[1].set_title("cost at the SLO")
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelsize=8)
    spec = data["projections"].get("spec") or {}
    fig.suptitle(f"sim: {spec.get('prompt_len')} in / {spec.get('output_len')} out, SLO p90 TTFT <= "
                 f"{spec.get('slo_ttft_s')} s, p90 TPOT <= {spec.get('slo_tpot_s')} s", fontsize=9)
    fig.tight_layout()
    return fig


# ---- the page -----------------------------------------------------------------------------------
def _e(v: Any) -> str:
    return html.escape(str(v))


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "-"}[v]
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str] | None = None) -> str:
    if not rows:
        return ""
    cols = list(cols or rows[0].keys())
    head = "".join(f"<th>{_e(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(v: Any) -> str:
    if v is True:
        return "<span class='ok'>ok</span>"
    if v is False:
        return "<span class='bad'>FAIL</span>"
    return _e(_fmt(v))


def _kv(d: Mapping[str, Any]) -> str:
    return _table([{"": k, "value": v} for k, v in d.items()])


def _img(name: str, plots: list[str]) -> str:
    return f"<img src='{_e(name)}' alt='{_e(name)}'>" if name in plots else ""


def render_html(data: dict[str, Any], out: Path) -> str:
    plots = data.get("plots") or []
    v, q, c, e, p = data["verify"], data["quality"], data["configuration"], data["engine"], data["projections"]
    name = Path(data["model"]["name"]).name
    verdict = v.get("verdict")
    parts = ["<!doctype html><html><head><meta charset='utf-8'>", f"<title>dossier: {_e(name)} on {_e(data['target'])}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>{_e(name)} on {_e(data['target'])}</h1>",
             f"<p>verdict: <span class='{'ok' if verdict == 'match' else 'bad'}'>{_e(verdict)}</span> "
             f"(verify {_e(v.get('source'))})</p>"]
    links = [f for f in ("RUNBOOK.md", "overrides.yaml", "state.json") if (out / f).is_file()]
    links += ["engine/bench/index.html"] if (out / "engine" / "bench" / "index.html").is_file() else []
    parts.append("<p>" + " | ".join(f"<a href='{_e(f)}'>{_e(f)}</a>" for f in ["dossier.json", *links]) + "</p>")

    parts.append("<h2>Verify: every path</h2>")
    if v.get("error"):
        parts.append(f"<pre>{_e(v['error'])}</pre>")
    parts.append(_table(v.get("paths") or [], ["path", "ok", "detail"]))
    if v.get("reasons"):
        parts.append("<ul>" + "".join(f"<li>{_e(r)}</li>" for r in v["reasons"]) + "</ul>")
    cul = v.get("culprit")
    if cul:
        parts.append(f"<p>culprit: <code>{_e(cul.get('op'))}</code> in <code>{_e(cul.get('module'))}</code> at "
                     f"<code>{_e(cul.get('source'))}</code>: <code>{_e(cul.get('code'))}</code></p>")
    for k, val in (v.get("findings") or {}).items():
        parts.append(f"<p>{_e(k)}: <code>{_e(json.dumps(val, default=str)[:400])}</code></p>")
    if v.get("extra"):
        parts.append("<p>other verify sections:</p>" + _kv(v["extra"]))
    parts.append(_img("dossier-verify.png", plots))

    parts.append("<h2>Quality</h2>")
    parts.append(_kv({k: val for k, val in q.items() if k != "measured"}) if q.get("measured")
                 else "<p>not measured: verify did not run the model</p>")

    parts.append("<h2>Configuration</h2>")
    parts.append(f"<p>target <code>{_e(c['target'])}</code>; overrides file: <code>{_e(c.get('overrides_file'))}</code></p>")
    parts.append(f"<pre>{_e(c.get('overrides_yaml') or '# no overrides: the chip defaults')}</pre>")
    pred = c.get("predicted")
    if pred:
        parts.append("<p>predicted on the chip by its spec (batch 1):</p>"
                     + _kv({k: pred.get(k) for k in ("chip", "prompt_len", "prefill_ms", "decode_step_ms",
                                                     "decode_tokens_per_s", "weight_bytes", "host_fallback_ms_per_step",
                                                     "kernels_per_step", "formula") if k in pred}))
    else:
        parts.append(f"<p>{_e(c.get('predicted_note'))}</p>")
    parts.append(f"<p>reproduce: <code>{_e(c['verify_command'])}</code><br><code>{_e(c['dossier_command'])}</code></p>")

    parts.append("<h2>Engine on this machine (measured)</h2>")
    parts.append(_engine_html(e))
    parts.append(_img("dossier-engine.png", plots))

    parts.append("<h2>Projections (simulated)</h2>")
    parts.append(_projection_html(p))
    parts.append(_img("dossier-projections.png", plots))

    parts.append("<h2>Environment</h2><pre>" + _e(json.dumps(data.get("environment"), indent=1, default=str))
                 + "</pre></body></html>")
    return "\n".join(x for x in parts if x)


def _engine_html(e: dict[str, Any]) -> str:
    if e.get("status") == "skipped":
        return f"<p>skipped ({_e(e.get('reason'))})</p>"
    m = e.get("machine") or {}
    spec = e.get("spec") or {}
    head = (f"<p>{_e(e.get('engine'))} driven by {_e(e.get('client'))}: {spec.get('num_requests')} requests of "
            f"{spec.get('input_len')} prompt / {spec.get('output_len')} output tokens, concurrency "
            f"{spec.get('concurrency')}; machine: {_e(m.get('cpu'))}, {m.get('num_cpus')} CPUs, server torch threads "
            f"{m.get('server_torch_threads')}, load average {_fmt(m.get('load_average_1m'))} before / "
            f"{_fmt(m.get('load_average_1m_after'))} after</p>")
    if e.get("status") != "ok":
        return head + (f"<p class='bad'>failed: {_e(e.get('reason'))}</p>"
                       f"<pre>{_e(e.get('server_log_tail') or '')}</pre>")
    rows = [{"metric": k, **(e.get(k) or {})} for k in ("ttft_ms", "tpot_ms", "e2e_ms")]
    return head + _table(rows) + _kv({"output tok/s": e.get("output_tokens_per_s"),
                                      "requests/s": e.get("request_throughput"),
                                      "tok/s per user (1000 / median TPOT)": e.get("tokens_per_s_per_user"),
                                      "server start (s)": e.get("server_start_s")})


def _projection_html(p: dict[str, Any]) -> str:
    if p.get("error"):
        return f"<p class='bad'>{_e(p['error'])}</p>"
    rows = p.get("chips") or []
    if not rows:
        return f"<p>{_e(p.get('note') or 'no chips')}</p>"
    spec = p.get("spec") or {}
    head = (f"<p>{_e(p.get('method'))}. Workload: {spec.get('prompt_len')} prompt / {spec.get('output_len')} output "
            f"tokens, {spec.get('weight_dtype')} weights; SLO p90 TTFT <= {spec.get('slo_ttft_s')} s, p90 TPOT <= "
            f"{spec.get('slo_tpot_s')} s.</p>")
    table = [{"chip": r["chip"], "hardware": r["hardware"], "fits": r.get("fits"), "tp": r.get("tp"),
              "meets SLO": r.get("meets_slo"), "req/s": r.get("rate_req_per_s"),
              "out tok/s": r.get("output_tokens_per_s"),
              "TTFT p50 / p99 (ms)": _pair(r.get("ttft_p50_s"), r.get("ttft_p99_s")),
              "TPOT p50 / p99 (ms)": _pair(r.get("tpot_p50_s"), r.get("tpot_p99_s")),
              "$/h per device": r.get("price_per_hour_usd"), "$ / 1M out tokens": r.get("usd_per_1m_output_tokens"),
              "note": r.get("reason") or ""} for r in rows]
    return head + _table(table)


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a * 1e3:.3g} / {b * 1e3:.3g}"
