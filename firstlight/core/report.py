"""A Report is a directory: result.json (with an environment manifest), PNG plots, index.html.

Every stage that reports (verify, bench, sim, benchmarks) writes through `write_report`, so all
reports share one layout and one manifest.
"""

from __future__ import annotations

import html
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

_PACKAGES = ("firstlight", "torch", "transformers", "numpy", "onnxruntime", "httpx", "gguf")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_manifest(**extra: Any) -> dict[str, Any]:
    """Versions, machine and time: what a reader needs to reproduce or discount a result."""
    manifest: dict[str, Any] = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "packages": {p: v for p in _PACKAGES if (v := _version(p))},
        "git_commit": _git_commit(),
        "argv": sys.argv,
    }
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        manifest["torch_num_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            manifest["device"] = torch.cuda.get_device_name(0)
    manifest.update(extra)
    return manifest


def _table_html(title: str, rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0].keys())
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<h2>{html.escape(title)}</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_report(
    out_dir: str | Path,
    result: Mapping[str, Any],
    *,
    title: str,
    figures: Mapping[str, Any] | None = None,
    tables: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    summary: str = "",
) -> Path:
    """Write `result.json`, each matplotlib figure as `<name>.png`, and an `index.html` embedding them.

    `result` gets an `environment` key (the manifest) unless it already has one.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = dict(result)
    data.setdefault("environment", environment_manifest())
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(out / "result.json")
    images = []
    for name, fig in (figures or {}).items():
        png = out / f"{name}.png"
        fig.savefig(png, dpi=110, bbox_inches="tight")
        images.append(png.name)
        try:
            import matplotlib.pyplot as plt

            plt.close(fig)
        except ImportError:
            pass
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}img{max-width:100%}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
    ]
    if summary:
        parts.append(f"<pre>{html.escape(summary)}</pre>")
    parts += [f"<h2>{html.escape(img[:-4])}</h2><img src='{img}'>" for img in images]
    parts += [_table_html(t, rows) for t, rows in (tables or {}).items()]
    parts.append("<h2>environment</h2><pre>")
    parts.append(html.escape(json.dumps(data["environment"], indent=2, default=str)))
    parts.append("</pre><p><a href='result.json'>result.json</a></p></body></html>")
    (out / "index.html").write_text("\n".join(parts))
    return out
