"""The reference's greedy continuation, cached on disk: bring-up loops verify many times against one reference.

The reference side of `verify` (HF transformers, fp32, sdpa) depends only on the checkpoint, the
prompt token ids, the number of new tokens and the library versions, never on the target. Its
expensive part is the greedy continuation: `generate` runs `new_tokens` sequential decode steps,
each reading every weight (1.3 s of a 2.2 s verify on SmolLM2-135M at one thread). Those tokens
are a few integers, so they are cached as a small JSON file:

    $FIRSTLIGHT_HOME/verify-cache/<sha256 of the key>.json
    {"format": 1, "key": {...the inputs below...}, "continuation": [ids...], "created_utc": ...}

The key holds: the checkpoint's fingerprint (per weight/config file the reference reads: name,
size, mtime_ns and, when a `firstlight pull` manifest lists the file with that size, its sha256),
the reference dtype and attention, the prompt ids, `new_tokens`, and the torch and transformers
versions (either can change fp32 numerics, so a near-tied greedy choice). Only the tokens are
cached: the reference's boundary tensors and logits are recomputed by one forward over prompt +
continuation on every run, exactly as without the cache, so a hit changes no reference tensor.

An entry that cannot be read, does not parse, or does not match its key is ignored with a
warning and rewritten; a failed write warns and the run goes on. Writes are atomic (a temp file
in the same dir, then `os.replace`), so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

FORMAT = 1
REFERENCE_DTYPE = "float32"
REFERENCE_ATTENTION = "sdpa"
# The files `AutoModelForCausalLM.from_pretrained` reads (weights, config, generation defaults).
_CHECKPOINT_GLOBS = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                     "pytorch_model*.bin", "pytorch_model.bin.index.json")


class ReferenceCacheWarning(RuntimeWarning):
    """A cache entry was unusable (ignored and recomputed) or could not be written (the run goes on)."""


def default_cache_dir() -> Path:
    from firstlight.models.hub import firstlight_home

    return firstlight_home() / "verify-cache"


def checkpoint_fingerprint(path: str | Path) -> list[dict[str, Any]]:
    """Per file the reference reads: name, bytes, mtime_ns, and the pull manifest's sha256 if it lists it.

    mtime is kept even when the manifest gives a hash: a file rewritten in place (say a fine-tune
    saved over a pulled model) changes it, and the manifest would not know. Hashing the weights
    here instead would cost more than the decode steps the cache saves.
    """
    from firstlight.models.hub import read_manifest

    ckpt = Path(path)
    manifest = read_manifest(ckpt) or {"files": {}}
    names = sorted({p.name for g in _CHECKPOINT_GLOBS for p in ckpt.glob(g) if p.is_file()})
    out = []
    for name in names:
        st = (ckpt / name).stat()
        entry = manifest["files"].get(name)
        sha = entry.get("sha256") if isinstance(entry, dict) and entry.get("bytes") == st.st_size else None
        out.append({"name": name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha})
    return out


def continuation_key(path: str | Path, prompt_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """Everything the reference's greedy continuation depends on."""
    import torch
    import transformers

    return {
        "checkpoint": checkpoint_fingerprint(path),
        "reference_dtype": REFERENCE_DTYPE,
        "attention": REFERENCE_ATTENTION,
        "prompt_ids": [int(t) for t in prompt_ids],
        "new_tokens": int(new_tokens),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class ContinuationCache:
    """Greedy continuations of the reference, one JSON file per key under `root`."""

    root: Path

    @classmethod
    def default(cls) -> ContinuationCache:
        """$FIRSTLIGHT_HOME/verify-cache (created on the first write)."""
        return cls(default_cache_dir())

    def entry_path(self, key: dict[str, Any]) -> Path:
        return Path(self.root) / f"{key_digest(key)}.json"

    def load(self, key: dict[str, Any], vocab_size: int) -> tuple[list[int] | None, str | None]:
        """(the cached continuation for `key` or None, why an existing entry was unusable or None)."""
        p = self.entry_path(key)
        try:
            return _validated(json.loads(p.read_text()), key, vocab_size), None
        except (FileNotFoundError, NotADirectoryError):  # absent (a bad root fails later, at the write)
            return None, None
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return None, f"reference cache entry {p} is unusable ({e}); ignored, regenerating"

    def store(self, key: dict[str, Any], continuation: list[int]) -> str | None:
        """Write atomically; returns why it could not (the cache never fails a run), or None."""
        p = self.entry_path(key)
        data = {"format": FORMAT, "key": key, "continuation": [int(t) for t in continuation],
                "created_utc": datetime.now(UTC).isoformat(timespec="seconds")}
        tmp = None
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.stem}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, p)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return f"could not write reference cache entry {p}: {e}"
        return None

    def discard(self, key: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # store() replaces it anyway
            self.entry_path(key).unlink(missing_ok=True)


def _validated(data: Any, key: dict[str, Any], vocab_size: int) -> list[int]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} entry")
    if data.get("key") != key:
        raise ValueError("its key does not match the one it is filed under")
    cont = data.get("continuation")
    if not isinstance(cont, list) or len(cont) != key["new_tokens"]:
        raise ValueError(f"continuation is not a list of {key['new_tokens']} token ids")
    if not all(type(t) is int and 0 <= t < vocab_size for t in cont):
        raise ValueError(f"continuation holds a token id outside [0, {vocab_size})")
    return cont
