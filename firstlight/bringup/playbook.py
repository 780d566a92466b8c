"""The playbook: what each remedy did for each failure signature, on which chip and model family.

One JSON file, `$FIRSTLIGHT_HOME/bringup/playbook.json` (or `--playbook FILE`), rewritten atomically
(temp file + rename) after every iteration, so an interrupted bring-up never leaves it half written.
A file that does not parse is moved aside (`.corrupt-<time>`) with a warning and a fresh one started:
the loop never loses its run to a bad playbook.

    {"version": 1, "entries": [{"signature": "accumulation:bf16", "kind": "accumulation",
      "chip": "wormhole-n300", "vendor": "Tenstorrent", "family": "llama", "model": "...",
      "remedy": "widen_accumulator", "candidate": "fp32 accumulator in layers.*.mlp.down_proj",
      "outcome": "fixed", "cost_ms": 0.4, "time": "2026-12-01T12:00:00Z"}],
     "configs": [{"chip": "wormhole-n300", "vendor": "Tenstorrent", "family": "llama", "model": "...",
      "kept": [{"remedy": ..., "description": ..., "rules": [...]}], "cost_ms": 476.8, "time": "..."}]}

`entries` rank single remedies for a signature; `configs` are whole passing configurations (the remedies
a bring-up kept, after its performance phase), which the next bring-up on the same chip tries first as
one step: the way an engineer starts a second model from the first one's working settings.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from firstlight.errors import FirstlightError

GOOD = ("fixed", "moved", "improved")  # outcomes that kept the remedy
# Credit from a configuration that met its goal, one entry per kept remedy: `essential` when the final
# configuration's numerics change without it, `superseded` when later remedies override all it set
# (an fp32 accumulator under a whole-model upcast). A remedy that only helped on the way is worth less
# to the next model than one the passing configuration needs.
CREDIT = ("essential", "superseded")
VERSION = 1


@dataclass(frozen=True)
class Entry:
    signature: str  # Signature.key()
    kind: str
    chip: str
    vendor: str
    family: str
    model: str
    remedy: str
    candidate: str
    outcome: str  # fixed | moved | improved | no_effect | worse | error; or a CREDIT outcome
    cost_ms: float | None = None  # change in predicted time per request (ms), when measured
    time: str = ""


def default_path() -> Path:
    from firstlight.models.hub import firstlight_home

    return firstlight_home() / "bringup" / "playbook.json"


class Playbook:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.entries: list[Entry] = []
        self.configs: list[dict[str, Any]] = []
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
                raise ValueError("no 'entries' list")
            configs = data.get("configs", [])
            if not isinstance(configs, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("kept"), list) for c in configs):
                raise ValueError("'configs' is not a list of configurations")
            self.entries, self.configs = [Entry(**e) for e in data["entries"]], configs
        except (ValueError, TypeError, OSError) as e:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            try:
                self.path.replace(aside)
            except OSError:
                aside = self.path
            warnings.warn(f"playbook {self.path} is unreadable ({e}); kept as {aside}, starting a new one",
                          stacklevel=2)

    def record(self, entry: Entry) -> None:
        stamped = Entry(**{**asdict(entry), "time": entry.time or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        self.entries.append(stamped)
        self.save()

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".playbook-", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": VERSION, "entries": [asdict(e) for e in self.entries],
                           "configs": self.configs}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as e:
            raise FirstlightError(f"cannot write the playbook {self.path}: {e}; give --playbook a writable path") from e

    def record_config(self, chip: str, vendor: str, family: str, model: str, kept: list[dict[str, Any]],
                      cost_ms: float | None) -> None:
        """A configuration that met its goal: the remedies kept (Candidate.to_dict()), in the order applied."""
        self.configs.append({"chip": chip, "vendor": vendor, "family": family, "model": model, "kept": kept,
                             "cost_ms": cost_ms, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        self.save()

    def prior_config(self, chip: str, family: str) -> dict[str, Any] | None:
        """The passing configuration to start a bring-up on `chip` from: the newest of the same model
        family on this chip, else the newest of any family on it (its module patterns are the shared
        `layers.*.<module>` names). Another chip's configuration is not offered: its formats and
        fidelities need not exist here. None when this chip has none, or it kept no remedy."""
        on_chip = [c for c in self.configs if c.get("chip") == chip and c["kept"]]
        same = [c for c in on_chip if c.get("family") == family]
        return (same or on_chip or [None])[-1]

    def score(self, remedy: str, signature: str, kind: str, chip: str, vendor: str, family: str) -> float:
        """Past evidence for trying `remedy` on this signature: successes minus failures, weighted by similarity."""
        total = 0.0
        for e in self.entries:
            if e.remedy != remedy or e.kind != kind:
                continue
            w = 1.0 if e.signature == signature else 0.4
            w *= 2.0 if e.chip == chip else 1.5 if e.vendor == vendor else 1.0
            w *= 1.5 if e.family == family else 1.0
            total += w if e.outcome in GOOD or e.outcome == "essential" else -0.5 * w
        return total

    def summary(self) -> list[dict[str, Any]]:
        """One row per (signature, remedy): tries, successes, chips and families seen."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for e in self.entries:
            r = rows.setdefault((e.signature, e.remedy), {"signature": e.signature, "remedy": e.remedy, "tries": 0,
                                                          "kept": 0, "essential": 0, "chips": set(), "families": set()})
            r["tries"] += e.outcome not in CREDIT
            r["kept"] += e.outcome in GOOD
            r["essential"] += e.outcome == "essential"
            r["chips"].add(e.chip)
            r["families"].add(e.family)
        return [{**r, "chips": sorted(r["chips"]), "families": sorted(r["families"])} for r in rows.values()]
