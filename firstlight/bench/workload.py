"""Workloads: what to send. Synthetic lengths, JSONL prompts, shared-prefix groups, multi-turn.

A workload is a deterministic function of (spec, seed, session index) -> Session, so any number of
requests can be drawn and a rerun with the same seed sends the same prompts. `cache_bust` puts a
per-run nonce at the very start of every prompt, which defeats prefix caches across runs while
keeping the sharing inside a shared-prefix run.

Without a tokenizer, synthetic text is made of common one-token English words, so "N input tokens"
is approximate (the server's `usage` gives the real count); with `--tokenizer DIR` (a checkpoint
dir or tokenizer.json) prompts are built from token ids and counted exactly.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from firstlight.errors import FirstlightError

_VOCAB = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "it", "an", "were", "are", "which", "this", "be", "or", "has", "had", "one", "not", "but", "first", "new", "two", "their", "after", "its", "who", "they", "have", "her", "she", "been", "also", "other", "more", "all", "some", "time", "into", "only", "over", "year", "most", "city", "made", "where", "then", "many", "when", "these", "world", "can", "would", "such", "used", "about", "him", "state", "three", "well", "school", "south", "known", "people", "between", "part", "both", "during", "under"]


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts: fixed:N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA."""

    kind: str
    a: float
    b: float = 0.0

    @staticmethod
    def parse(spec: str | int, what: str = "length") -> LengthDist:
        s = str(spec).strip().lower()
        parts = s.split(":")
        try:
            if len(parts) == 1:
                return LengthDist("fixed", float(int(parts[0])))
            kind, nums = parts[0], [float(x) for x in parts[1:]]
        except ValueError:
            raise FirstlightError(_dist_help(what, spec)) from None
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}
        if kind not in arity or len(nums) != arity[kind] or any(x < 0 for x in nums):
            raise FirstlightError(_dist_help(what, spec))
        if kind == "uniform" and nums[1] < nums[0]:
            raise FirstlightError(f"{what} {spec!r}: uniform needs LO <= HI.")
        return LengthDist(kind, *nums)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        else:  # lognormal: median a, shape sigma b
            x = rng.lognormvariate(math.log(max(self.a, 1.0)), self.b)
        return max(1, int(round(x)))

    def __str__(self) -> str:
        return f"{self.kind}:{self.a:g}" + (f":{self.b:g}" if self.kind != "fixed" else "")


def _dist_help(what: str, spec: object) -> str:
    return (f"{what} {spec!r} does not parse: expected N, fixed:N, uniform:LO:HI, normal:MEAN:STD or "
            "lognormal:MEDIAN:SIGMA with non-negative numbers.")


@dataclass
class Turn:
    text: str  # the user message / completion prompt
    max_tokens: int
    input_tokens: int | None = None  # by the local tokenizer, when there is one


@dataclass
class Session:
    """One conversation: its turns are sent one after another, each with the history so far."""

    index: int
    turns: list[Turn]
    group: int | None = None


@dataclass
class WorkloadSpec:
    kind: str = "synthetic"  # synthetic | jsonl | shared-prefix | multi-turn
    input_len: str = "fixed:128"
    output_len: str = "fixed:128"
    path: str | None = None  # jsonl
    num_groups: int = 4  # shared-prefix
    prefix_len: int = 256
    num_turns: int = 3  # multi-turn
    seed: int = 0
    cache_bust: bool = False
    tokenizer: str | None = None
    run_nonce: str = ""  # filled in by Workload when cache_bust

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_tokenizer(path: str | None) -> Any:
    """A `tokenizers.Tokenizer` from a checkpoint dir or a tokenizer.json file, or None."""
    if not path:
        return None
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise FirstlightError(f"tokenizer {path!r}: no tokenizer.json there; pass a checkpoint dir that has one.")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises its own exception type
        raise FirstlightError(f"tokenizer {f}: could not be loaded ({e}).") from None


def count_tokens(tok: Any, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def read_jsonl_prompts(path: str) -> list[dict[str, Any]]:
    """Rows with `prompt` (str) or `messages` (chat list), optional `output_len`/`max_tokens`."""
    p = Path(path)
    if not p.is_file():
        raise FirstlightError(f"workload file {path!r} does not exist.")
    rows: list[dict[str, Any]] = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise FirstlightError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be one JSON object.") from None
            if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)):
                raise FirstlightError(f"{path}:{n}: expected an object with a 'prompt' string or a 'messages' list.")
            out = row.get("output_len", row.get("max_tokens"))
            if out is not None and (not isinstance(out, int) or out < 1):
                raise FirstlightError(f"{path}:{n}: 'output_len' must be a positive integer, got {out!r}.")
            rows.append(row)
    if not rows:
        raise FirstlightError(f"workload file {path!r} has no prompts.")
    return rows


class Workload:
    """Draws sessions deterministically: session i depends only on (spec, i)."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        if spec.kind not in ("synthetic", "jsonl", "shared-prefix", "multi-turn"):
            raise FirstlightError(f"workload {spec.kind!r}: expected synthetic, jsonl, shared-prefix or multi-turn.")
        self.input_len = LengthDist.parse(spec.input_len, "--input-len")
        self.output_len = LengthDist.parse(spec.output_len, "--output-len")
        self.tok = load_tokenizer(spec.tokenizer)
        if spec.cache_bust and not spec.run_nonce:
            spec.run_nonce = uuid.uuid4().hex[:12]
        self.rows = read_jsonl_prompts(spec.path) if spec.kind == "jsonl" else []
        if spec.kind == "jsonl" and not spec.path:
            raise FirstlightError("workload jsonl needs --prompts FILE.")
        self.prefixes = [self._text(random.Random(f"{spec.seed}-prefix-{g}"), spec.prefix_len)
                         for g in range(spec.num_groups)] if spec.kind == "shared-prefix" else []
        self._vocab_ids: list[int] | None = None

    def _text(self, rng: random.Random, n: int) -> str:
        if self.tok is None:
            return " ".join(rng.choices(_VOCAB, k=n))
        if self._vocab_ids is None:
            special = {t.content for t in self.tok.get_added_tokens_decoder().values()} if hasattr(
                self.tok, "get_added_tokens_decoder") else set()
            vocab = self.tok.get_vocab()
            self._vocab_ids = sorted(i for t, i in vocab.items() if t not in special and t.isalpha())[:20000] or \
                sorted(vocab.values())
        ids = rng.choices(self._vocab_ids, k=n)
        text = self.tok.decode(ids)
        # re-encode and cut, so the count is exact for this tokenizer
        enc = self.tok.encode(text, add_special_tokens=False)
        if len(enc.ids) > n:
            text = text[: enc.offsets[n - 1][1]]
        return text

    def _bust(self, text: str, session: int) -> str:
        return f"[{self.spec.run_nonce}] {text}" if self.spec.cache_bust else text

    def session(self, i: int) -> Session:
        s = self.spec
        rng = random.Random(f"{s.seed}-{i}")
        if s.kind == "jsonl":
            row = self.rows[i % len(self.rows)]
            out = row.get("output_len", row.get("max_tokens")) or self.output_len.sample(rng)
            if "messages" in row:
                msgs = [dict(m) for m in row["messages"]]
                if s.cache_bust and msgs:
                    msgs[0]["content"] = self._bust(str(msgs[0].get("content", "")), i)
                return Session(i, [MessagesTurn("", out, messages=msgs)])
            turn = Turn(self._bust(row["prompt"], i), out)
            return self._counted(Session(i, [turn]))
        if s.kind == "shared-prefix":
            g = i % s.num_groups
            body = self._text(rng, self.input_len.sample(rng))
            return self._counted(Session(i, [Turn(self._bust(self.prefixes[g] + " " + body, i),
                                                  self.output_len.sample(rng))], group=g))
        n_turns = s.num_turns if s.kind == "multi-turn" else 1
        turns = [Turn(self._text(rng, self.input_len.sample(rng)), self.output_len.sample(rng)) for _ in range(n_turns)]
        turns[0].text = self._bust(turns[0].text, i)
        return self._counted(Session(i, turns))

    def session_with_lengths(self, i: int, input_len: int, output_len: int) -> Session:
        """A single-turn synthetic session of given lengths (trace replay)."""
        rng = random.Random(f"{self.spec.seed}-{i}")
        return self._counted(Session(i, [Turn(self._bust(self._text(rng, input_len), i), output_len)]))

    def _counted(self, sess: Session) -> Session:
        if self.tok is not None:
            for t in sess.turns:
                t.input_tokens = count_tokens(self.tok, t.text)
        return sess


@dataclass
class MessagesTurn(Turn):
    """A JSONL row that already holds a chat message list."""

    messages: list[dict[str, Any]] = field(default_factory=list)
