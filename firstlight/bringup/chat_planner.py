"""A planner that asks a chat model which remedy to try next, through OpenAI-style function calling.

    firstlight bringup ... --planner chat --planner-url http://127.0.0.1:8000 --planner-model NAME

Any OpenAI-compatible server works (`POST {url}/v1/chat/completions` with `tools`; vLLM, llama.cpp's
server, SGLang, a hosted API). Each time the loop needs the next remedy, the planner sends the
failure signature, the chip and model family, and the candidates in the playbook's order, and
offers these tools (the loop's own, as far as choosing is concerned):

    localize()                       the evidence verify gathered: the signature's fields (failing op,
                                     module, source line, error figures) and the share of units failing
    candidate_details(candidate_index) the override rules a candidate applies, its remedy's known cost,
                                     and how often the playbook saw it work for this kind of failure
    choose_remedy(candidate_index, reason)   the decision; ends the exchange

The loop itself still verifies, applies the chosen override, keeps or reverts it: a chat model only
changes the order in which candidates are tried, so it cannot make the loop skip a check. Anything
but a valid `choose_remedy` within `max_rounds` requests (the server is down or slow, the answer is
not JSON, an unknown tool, an index out of range, plain text) falls back to the playbook order, and
the reason is kept in `decisions` (one dict per call of `rank`; `firstlight bringup` also appends
each to `OUT/planner.jsonl`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from firstlight.bringup.planner import Planner, RunInfo
from firstlight.bringup.remedies import Candidate
from firstlight.bringup.signatures import Signature
from firstlight.errors import FirstlightError

SYSTEM = (
    "You help bring a language model up on an accelerator whose arithmetic differs from the reference's. "
    "Verify found a failure; pick the remedy to try next from the numbered candidates. The loop re-verifies "
    "after applying it, keeps it if the failure vanished or moved, and reverts it otherwise, so prefer the "
    "candidate most likely to fix this failure at the lowest cost. Call localize or candidate_details if you "
    "need evidence, then call choose_remedy exactly once."
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "localize", "description": "The evidence verify gathered about the failure: failing op, module, "
        "source line, error figures, and the fraction of the model's units that fail.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "candidate_details", "description": "The override rules a candidate applies, the known cost of its "
        "remedy, and how often the playbook saw that remedy work for this failure.",
        "parameters": {"type": "object", "properties": {"candidate_index": {"type": "integer", "minimum": 0}},
                       "required": ["candidate_index"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "choose_remedy", "description": "Try this candidate next.",
        "parameters": {"type": "object", "properties": {
            "candidate_index": {"type": "integer", "minimum": 0, "description": "index in the candidate list"},
            "reason": {"type": "string", "description": "one sentence: why this one"}},
            "required": ["candidate_index", "reason"], "additionalProperties": False}}},
]


class ChatPlannerError(FirstlightError):
    """The chat server failed or answered something the planner cannot use (the loop falls back)."""


@dataclass
class ChatConfig:
    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0  # per request
    max_rounds: int = 4  # requests per decision (tool results go back to the model between them)
    temperature: float = 0.0

    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        if base.endswith("/chat/completions"):
            return base
        return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


class ChatPlanner:
    def __init__(self, config: ChatConfig, fallback: Planner, playbook: Any = None,
                 log_path: Path | None = None) -> None:
        self.config = config
        self.fallback = fallback
        self.playbook = playbook if playbook is not None else getattr(fallback, "playbook", None)
        self.decisions: list[dict[str, Any]] = []
        self.log_path = log_path  # each decision appended as one JSON line (the bring-up's planner.jsonl)

    def rank(self, sig: Signature, candidates: list[Candidate], info: RunInfo, spread: float = 0.0,
             kept: Sequence[Candidate] = ()) -> list[Candidate]:
        """The chat model's choice first, then the rest in playbook order; the playbook order on any failure."""
        base = self.fallback.rank(sig, candidates, info, spread, kept)
        decision: dict[str, Any] = {"signature": sig.describe(), "num_candidates": len(base)}
        ranked = base
        if len(base) < 2:
            decision["fallback"] = "fewer than two candidates: nothing to choose"
        else:
            try:
                index, reason, rounds = self._ask(sig, base, info, spread)
                decision.update(chosen=base[index].description, remedy=base[index].remedy, index=index,
                                reason=reason, rounds=rounds)
                ranked = [base[index], *base[:index], *base[index + 1:]]
            except ChatPlannerError as e:
                decision["fallback"] = str(e)
        self.decisions.append(decision)
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(decision) + "\n")
        return ranked

    # ---- one decision ---------------------------------------------------------------------------------
    def _ask(self, sig: Signature, cands: list[Candidate], info: RunInfo, spread: float) -> tuple[int, str, int]:
        listing = "\n".join(f"{i}. [{c.remedy}] {c.description}" for i, c in enumerate(cands))
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Chip: {info.chip} ({info.vendor}). Model family: {info.family}.\n"
                                        f"Failure: {sig.describe()}\nCandidates (playbook order):\n{listing}"}]
        for rounds in range(1, self.config.max_rounds + 1):
            msg = self._post(messages)
            calls = msg.get("tool_calls") or []
            if not calls:
                raise ChatPlannerError(f"the model answered without a tool call: {str(msg.get('content'))[:120]!r}")
            messages.append({"role": "assistant", "content": msg.get("content") or "", "tool_calls": calls})
            for call in calls:
                name, args = _parse_call(call)
                if name == "choose_remedy":
                    return _choice(args, len(cands)), str(args.get("reason", ""))[:500], rounds
                result = self._tool(name, args, sig, cands, info, spread)
                messages.append({"role": "tool", "tool_call_id": call.get("id", name), "content": json.dumps(result)})
        raise ChatPlannerError(f"no choose_remedy call in {self.config.max_rounds} requests")

    def _post(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        import httpx

        body = {"model": self.config.model, "messages": messages, "tools": TOOLS, "tool_choice": "auto",
                "temperature": self.config.temperature}
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        try:
            r = httpx.post(self.config.endpoint(), json=body, headers=headers, timeout=self.config.timeout_s)
        except httpx.HTTPError as e:
            raise ChatPlannerError(f"chat server {self.config.endpoint()}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise ChatPlannerError(f"chat server {self.config.endpoint()} answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            msg = r.json()["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ChatPlannerError(f"chat server answered no choices[0].message: {r.text[:200]!r}") from None
        if not isinstance(msg, dict):
            raise ChatPlannerError(f"chat server's message is not an object: {msg!r:.200}")
        return msg

    def _tool(self, name: str, args: dict[str, Any], sig: Signature, cands: list[Candidate], info: RunInfo,
              spread: float) -> dict[str, Any]:
        if name == "localize":
            return {"signature": sig.to_dict(), "fraction_of_units_failing": round(spread, 3)}
        if name == "candidate_details":
            i = _choice(args, len(cands))
            c = cands[i]
            from firstlight.bringup.remedies import load_builtin

            remedy = load_builtin().get(c.remedy)
            out = {**c.to_dict(), "cost_rank": c.cost_rank, "known_cost": remedy.cost if remedy else None}
            if self.playbook is not None:
                out["playbook_score"] = self.playbook.score(c.remedy, sig.key(), sig.kind, info.chip, info.vendor,
                                                            info.family)
            return out
        raise ChatPlannerError(f"the model called an unknown tool {name!r}")


def _parse_call(call: Any) -> tuple[str, dict[str, Any]]:
    try:
        fn = call["function"]
        name = str(fn["name"])
        raw = fn.get("arguments") or "{}"
        args = json.loads(raw) if isinstance(raw, str) else raw
    except (KeyError, TypeError, ValueError):
        raise ChatPlannerError(f"a tool call that does not parse: {str(call)[:200]}") from None
    if not isinstance(args, dict):
        raise ChatPlannerError(f"tool {name} arguments are not an object: {args!r:.120}")
    return name, args


def _choice(args: dict[str, Any], n: int) -> int:
    i = args.get("candidate_index")
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
        raise ChatPlannerError(f"candidate_index {i!r} is not one of 0..{n - 1}")
    return i


PLANNERS = ("playbook", "chat")


def planner_from_options(name: str, url: str | None, model: str | None, playbook: Any,
                         log_path: Path | None = None) -> Planner:
    """The planner `--planner NAME [--planner-url URL --planner-model M]` asks for; FirstlightError (exit 2) if bad.

    The chat planner's API key, if its server needs one, comes from $FIRSTLIGHT_PLANNER_API_KEY.
    """
    import os

    from firstlight.bringup.planner import PlaybookPlanner

    if name not in PLANNERS:
        raise PlannerOptionError(f"--planner '{name}': expected one of {', '.join(PLANNERS)}")
    base = PlaybookPlanner(playbook)
    if name == "playbook":
        return base
    if not url or not model:
        raise PlannerOptionError("--planner chat needs --planner-url (an OpenAI-compatible server, e.g. "
                                 "http://127.0.0.1:8000) and --planner-model (the model name it serves)")
    if not url.startswith(("http://", "https://")):
        raise PlannerOptionError(f"--planner-url '{url}': expected an http:// or https:// URL")
    return ChatPlanner(ChatConfig(url=url, model=model, api_key=os.environ.get("FIRSTLIGHT_PLANNER_API_KEY")), base,
                       log_path=log_path)


class PlannerOptionError(FirstlightError):
    exit_code = 2
