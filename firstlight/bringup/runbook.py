"""RUNBOOK.md and overrides.yaml of a bring-up, rewritten (atomically) after every verify run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from firstlight.bringup.loop import BringupState


def _fmt(v: Any, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def _evidence(after: dict[str, Any]) -> str:
    if after.get("error"):
        return after["error"].split(". Override")[0]
    m = after.get("metrics") or {}
    parts = [f"{k} {_fmt(m[k])}" for k in ("kl", "ppl", "top1", "units") if k in m]
    c = after.get("culprit")
    if c:
        parts.append(f"culprit {c['op']} in {c['module']} ({c.get('source') or '?'})")
    return "; ".join(parts)


def render(state: BringupState, command: str, overrides_file: str) -> str:
    lines = [f"# Bring-up runbook: {Path(state.model).name} on {state.chip}", "",
             f"- goal: `{state.goal}`", f"- status: **{state.status}** (phase: {state.phase})",
             f"- verify runs: {len(state.iterations)}", ""]
    lines += ["## Iterations", "",
              "| run | phase | signature | remedy | outcome | evidence after | predicted ms/request | change ms |",
              "|---:|---|---|---|---|---|---:|---:|"]
    for it in state.iterations:
        sig = it.get("signature") or {}
        rem = it.get("remedy") or {}
        after = it.get("after") or {}
        desc = sig.get("key", "") + (f" @ {sig.get('module') or sig.get('unit') or ''}".rstrip(" @") if sig else "")
        lines.append(f"| {it['run']} | {it['phase']}{' (' + it['change'] + ')' if it.get('change') else ''} | "
                     f"{desc or '-'} | {rem.get('description', '-')} | {it.get('outcome') or ('met' if after.get('met') else '-')} | "
                     f"{_evidence(after) or '-'} | {_fmt(after.get('cost_ms'), '.3f')} | {_fmt(it.get('cost_delta_ms'), '+.3f')} |")
    noop = [s for s in state.skipped if s["change"] == "no-op"]
    priced = [s for s in state.skipped if s["change"] != "no-op"]
    if noop:
        lines += ["", "Correctness candidates not run, because they change the numerics of no op the last run "
                  "dispatched (remedies already kept cover them):", ""]
        lines += [f"- {s['description']} (for {s['signature']})" for s in noop]
    if priced:
        lines += ["", "Performance candidates not run, because the spec prices them no faster than the configuration "
                  "they would replace (a later rule overrides them, or the op is not on the critical resource), or "
                  "they compute what removing the remedy computes:", ""]
        lines += [f"- {s['change']} {s['description']}: " + (s["why"] if s.get("why") else
                  f"{_fmt(s['predicted_ms'], '.3f')} ms vs {_fmt(s['current_ms'], '.3f')} ms") for s in priced]
    lines += ["", "## Remedies kept", ""]
    credit = {c["description"]: c["credit"] for c in state.credit}
    lines += [f"{i + 1}. **{c['remedy']}**: {c['description']}"
              + (f" ({credit[c['description']]} in the passing configuration)" if c["description"] in credit else "")
              for i, c in enumerate(state.kept)] or ["(none)"]
    if state.final:
        f = state.final
        pred = f.get("predicted") or {}
        lines += ["", "## Result", "",
                  f"- goal met: **{f.get('met')}**" + (f" (unmet: {'; '.join(f.get('unmet') or [])})" if not f.get("met") else ""),
                  "- quality: " + ", ".join(f"{k} {_fmt(v)}" for k, v in (f.get("metrics") or {}).items()),
                  f"- predicted on {pred.get('chip', state.chip)}: prefill {_fmt(pred.get('prefill_ms'), '.3f')} ms, "
                  f"decode step {_fmt(pred.get('decode_step_ms'), '.3f')} ms = {_fmt(pred.get('decode_tokens_per_s'), '.1f')} "
                  f"tokens/s; {_fmt(f.get('cost_ms'), '.3f')} ms per request (128-token prompt + 32 tokens)"]
    lines += ["", "## Final overrides", "", f"`{overrides_file}`:", "", "```yaml",
              yaml.safe_dump(state.overrides or {"rules": []}, sort_keys=False).rstrip(), "```",
              "", "## Reproduce", "", "```bash", command, "```", ""]
    return "\n".join(lines)


def write(out: Path, state: BringupState, model: str) -> None:
    overrides_file = out / "overrides.yaml"
    _atomic(overrides_file, yaml.safe_dump({"chip": state.chip, **state.overrides}, sort_keys=False))
    command = (f"firstlight verify --model {model} --target emulate:{state.chip} --overrides {overrides_file}")
    _atomic(out / "RUNBOOK.md", render(state, command, str(overrides_file)))


def _atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
