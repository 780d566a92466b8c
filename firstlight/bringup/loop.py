"""The bring-up loop on an emulated chip: correctness first, then the speed the remedies cost.

    compile -> run -> verify -> localize -> classify -> remedy (an override) -> re-verify
      keep the remedy if the failure vanished or moved and nothing got worse; revert it otherwise
      until the goal holds or the budget of verify runs is spent
    (first, when the playbook holds a passing configuration on this chip: all its remedies at once)
    performance phase: for each kept remedy, newest first, try without it, then its cheaper
      variants (lower fidelity, narrower format, ...); keep the cheapest configuration that still
      meets the goal, by the chip spec's predicted time per request

The state (kept remedies, tried candidates, every iteration) is written to `OUT/state.json` after
each verify run, and the runbook with it, so an interrupted bring-up can be read and rerun: a rerun
with the same `--out` continues where it stopped.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from firstlight.bringup import remedies as R
from firstlight.bringup.goal import Goal, metric_values
from firstlight.bringup.planner import Planner, PlaybookPlanner, RunInfo
from firstlight.bringup.playbook import CREDIT, GOOD, Entry, Playbook
from firstlight.bringup.signatures import Accumulation, Context, OpClassError, Signature, classify
from firstlight.errors import FirstlightError
from firstlight.targets.base import OpNotLoweredError, TargetError
from firstlight.targets.emulated import EmulatedTarget
from firstlight.targets.overrides import OverrideRule, Overrides
from firstlight.verify.harness import VerifyConfig, run_verify

# A request: a 128-token prompt (priced prefill) and 32 generated tokens.
DECODE_TOKENS = 32


class BringupError(FirstlightError):
    exit_code = 2


@dataclass
class Evaluation:
    """One verify run of one configuration."""

    result: dict[str, Any] | None
    error: str | None
    signature: Signature | None
    unmet: list[str]
    cost_ms: float | None  # predicted ms per request on the chip
    target: EmulatedTarget
    seconds: float = 0.0  # wall time of this verify run

    @property
    def met(self) -> bool:
        return self.result is not None and not self.unmet

    def spread(self) -> float:
        """Fraction of verify's units (isolated boundaries) over tolerance."""
        rows = [b for b in (self.result or {}).get("boundaries", []) if "isolated" in b]
        return sum(not b["isolated"]["ok"] for b in rows) / len(rows) if rows else 0.0

    def metrics(self) -> dict[str, float]:
        if self.result is None:
            return {}
        m = metric_values(self.result)
        m["first_failing_index"] = _first_failing_index(self.result)
        return m


def _first_failing_index(result: dict[str, Any]) -> float:
    names = [b["name"] for b in result.get("boundaries", [])]
    bad = [i for i, b in enumerate(result.get("boundaries", [])) if not b.get("isolated", {}).get("ok", True)]
    return float(bad[0]) if bad else float(len(names))


def judge(before: Evaluation, after: Evaluation) -> str:
    """fixed | moved | improved | no_effect | worse | error (module doc: keep the first three)."""
    if after.result is None and after.signature is None:
        return "error"
    if after.met:
        return "fixed"
    if before.result is None:  # it did not compile before
        if after.result is not None:
            return "moved"
        same = after.signature is not None and before.signature is not None \
            and after.signature.describe() == before.signature.describe()
        return "no_effect" if same else "moved"
    if after.result is None:
        return "worse"  # it compiled before and does not now
    b, a = before.metrics(), after.metrics()
    # Thresholds with absolute floors: a verify of a few hundred tokens measures KL to about 1e-3 nats,
    # perplexity to about 1%, top-1 to a couple of its ~40 positions, and a boundary or two can cross
    # its tolerance on rounding alone.
    kl_a, kl_b, dev_a, dev_b = a.get("kl", 0.0), b.get("kl", 0.0), _ppl_dev(a), _ppl_dev(b)
    # KL averages the whole distribution over every position; the perplexity ratio of a short text reads
    # only the true token's probability and can sit near 1 by cancelling errors (Gemma 3 on Wormhole:
    # an exact GELU took KL 0.099 -> 0.077 and the ratio 1.003 -> 1.047). So a remedy that clearly lowers
    # KL is not called worse on perplexity alone.
    kl_better = kl_a < 0.8 * kl_b - 1e-4
    if kl_a > 1.25 * kl_b + 1e-3 or (dev_a > 1.25 * dev_b + 0.01 and not kl_better) \
            or a.get("top1", 1) < b.get("top1", 1) - 0.05 or a["units"] > 1.1 * b["units"] + 2:
        return "worse"
    if a["first_failing_index"] > b["first_failing_index"]:
        return "moved"
    if kl_better or dev_a < 0.8 * dev_b - 0.002 or a["units"] < 0.9 * b["units"] - 1:
        return "improved"
    return "no_effect"


def _ppl_dev(m: dict[str, float]) -> float:
    return abs(m["ppl"] - 1.0) if "ppl" in m else 0.0


@dataclass
class BringupConfig:
    model_path: Path
    chip: str
    goal: Goal = field(default_factory=Goal)
    budget: int = 12  # verify runs for correctness
    perf_budget: int = 8  # verify runs for the performance phase
    out: Path = Path("bringup")
    base_overrides: Overrides = field(default_factory=Overrides)
    # Smaller than verify's defaults (every path still runs): each bring-up iteration is one verify.
    verify: VerifyConfig = field(default_factory=lambda: VerifyConfig(new_tokens=8, ppl_tokens=128, ppl_window=64,
                                                                       ppl_stride=32))
    prompt_ids: list[int] | None = None
    ppl_ids: list[int] | None = None
    seed: int = 0


@dataclass
class BringupState:
    model: str
    chip: str
    goal: str
    kept: list[dict[str, Any]] = field(default_factory=list)  # candidates, in the order applied
    overrides: dict[str, Any] = field(default_factory=dict)  # base rules + kept candidates' rules
    tried: dict[str, list[str]] = field(default_factory=dict)  # signature -> candidate keys tried
    # candidates reverted, with how many remedies were kept then: once more are kept, the error they
    # targeted may dominate, so each is retried once when no new candidate is left (see _retry)
    reverted: list[dict[str, Any]] = field(default_factory=list)
    iterations: list[dict[str, Any]] = field(default_factory=list)
    # performance candidates not run: the spec predicts them no faster than what is kept (description, ms)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    # once the goal is met: per kept remedy, essential or superseded (see _credit)
    credit: list[dict[str, Any]] = field(default_factory=list)
    # the playbook's passing configuration this bring-up started from: {"model": ..., "outcome": ...};
    # {"model": None} when the playbook had none for the chip; {} until the loop has looked
    prior: dict[str, Any] = field(default_factory=dict)
    phase: str = "correctness"  # correctness | performance | done
    status: str = "running"  # running | met | budget_spent | no_remedy | interrupted
    final: dict[str, Any] = field(default_factory=dict)

    def save(self, out: Path) -> None:
        _atomic_write(out / "state.json", json.dumps(self.__dict__, indent=1, default=str))

    @classmethod
    def load(cls, out: Path) -> BringupState | None:
        p = out / "state.json"
        if not p.is_file():
            return None
        try:
            return cls(**json.loads(p.read_text()))
        except (ValueError, TypeError) as e:
            raise BringupError(f"{p} is not a bring-up state ({e}); remove it or give another --out") from None


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _candidate(d: dict[str, Any]) -> R.Candidate:
    return R.Candidate(d["remedy"], tuple(OverrideRule(**r) for r in d["rules"]), d["description"])


class BringupLoop:
    def __init__(self, cfg: BringupConfig, playbook: Playbook, planner: Planner | None = None,
                 on_iteration: Callable[[BringupState], None] | None = None) -> None:
        from firstlight.core.hardware import load_spec
        from firstlight.models.loader import load_config, load_model
        from firstlight.verify.harness import load_reference

        self.cfg = cfg
        self.playbook = playbook
        self.planner = planner or PlaybookPlanner(playbook)
        self.on_iteration = on_iteration or (lambda s: None)
        self.spec = load_spec(cfg.chip)
        self.model_cfg = load_config(cfg.model_path)
        self.info = RunInfo(chip=self.spec.name, vendor=self.spec.vendor, family=self.model_cfg.family,
                            model=str(cfg.model_path))
        self.reference = load_reference(cfg.model_path)
        self._pristine = load_model(cfg.model_path, torch.float32, with_tokenizer=False)[0]
        self.state = BringupState.load(cfg.out) or BringupState(model=str(cfg.model_path), chip=cfg.chip,
                                                                goal=cfg.goal.text)
        if (self.state.model, self.state.chip) != (str(cfg.model_path), cfg.chip):
            raise BringupError(f"{cfg.out} holds a bring-up of {self.state.model} on {self.state.chip}; "
                               "give another --out for a different model or chip")
        self.runs = max((it["run"] for it in self.state.iterations), default=0)  # a rerun continues the count
        self.kept: list[R.Candidate] = [_candidate(c) for c in self.state.kept]

    # ---- one configuration ------------------------------------------------------------------------
    def overrides(self, kept: list[R.Candidate]) -> Overrides:
        return self.cfg.base_overrides.plus(*(r for c in kept for r in c.rules))

    def evaluate(self, kept: list[R.Candidate]) -> Evaluation:
        self.runs += 1
        t0 = time.perf_counter()
        target = EmulatedTarget(chip=self.cfg.chip, overrides=self.overrides(kept), seed=self.cfg.seed)
        model = copy.deepcopy(self._pristine)  # the target hooks the model it prepares: one fresh copy per run
        ctx = Context(accumulator=lambda m, op: target.site_numerics(m, op).matmul.accumulator,
                      reduction_len=lambda m: _in_features(model, m))
        try:
            res = run_verify(self.cfg.model_path, target, f"emulate:{self.cfg.chip}", self.cfg.prompt_ids,
                             self.cfg.verify, ppl_ids=self.cfg.ppl_ids, reference=self.reference, model=model)
        except OpNotLoweredError as e:
            return Evaluation(None, str(e), classify(None, e, ctx), [str(e)], None, target, time.perf_counter() - t0)
        except TargetError as e:  # the configuration cannot run (e.g. an override the chip's numerics reject)
            if not kept:
                raise  # the chip's own defaults: nothing the loop can remedy
            return Evaluation(None, str(e), None, [str(e)], None, target, time.perf_counter() - t0)
        finally:
            # an Evaluation keeps its target (site numerics, pricing) but not the weights it prepared:
            # at HiFi4 they are several times the model (Gemma 3 270M: ~3 GB per kept run)
            target.release_prepared()
        result = res.to_dict()
        unmet = self.cfg.goal.unmet(result)
        sig = classify(result, None, ctx) if unmet else None
        pred = (result.get("target_report") or {}).get("details", {}).get("predicted") or {}
        cost = pred["prefill_ms"] + DECODE_TOKENS * pred["decode_step_ms"] if pred else None
        return Evaluation(result, None, sig, unmet, cost, target, time.perf_counter() - t0)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> BringupState:
        st = self.state
        kept = self.kept
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        current = self.evaluate(kept)
        self._log("baseline" if not st.iterations else "resume", current, None, None)
        if st.phase == "correctness":
            current = self._correctness(kept, current)
        if st.phase == "performance":
            current = self._performance(kept, current)
        st.phase = "done"
        st.final = {"met": current.met,
                    "cost_ms": current.cost_ms, "unmet": current.unmet, "metrics": current.metrics(),
                    "predicted": ((current.result or {}).get("target_report") or {}).get("details", {}).get("predicted"),
                    "verify_runs": self.runs}
        self._save()
        if current.met:
            self.playbook.record_config(self.info.chip, self.info.vendor, self.info.family, self.info.model,
                                        [c.to_dict() for c in kept], current.cost_ms)
        self.final_result = current.result
        return st

    def _correctness(self, kept: list[R.Candidate], current: Evaluation) -> Evaluation:
        st = self.state
        while not current.met:
            if self.runs >= self.cfg.budget:
                st.status = "budget_spent"
                return current
            if not st.prior:
                current = self._from_prior(kept, current)
                continue
            sig = current.signature
            assert sig is not None
            sig = self._refuted(sig)
            ctx = R.RemedyContext(numerics=current.target.numerics, site=current.target.site_numerics,
                                  modules=[p for p, _ in current.target._model.named_modules()]
                                  if current.target._model is not None else [])
            tried = st.tried.setdefault(sig.describe(), [])
            # the planner ranks only what is left to try (a chat planner must not pick a tried one)
            untried = [c for c in R.candidates(sig, ctx) if c.key not in tried and c.key not in {k.key for k in kept}]
            for c in [c for c in untried if not self.changes_numerics(c, current)]:
                # e.g. bf16 weights everywhere once the whole model is upcast: a verify run would show nothing
                untried.remove(c)
                tried.append(c.key)
                st.skipped.append({"description": c.description, "change": "no-op", "signature": sig.describe()})
            cands = self.planner.rank(sig, untried, self.info, spread=current.spread(), kept=kept) if untried else []
            phase = "correctness"
            if not cands:
                cands, phase = self._retry(kept, current), "retry"
            if not cands:
                st.status = "no_remedy"
                self._log("no remedy left", current, sig, None)
                return current
            cand = cands[0]
            trial = self.evaluate([*kept, cand])
            outcome = judge(current, trial)
            tried.append(cand.key)
            before = current
            if outcome in GOOD:
                kept.append(cand)
                current = trial
            elif outcome != "error" and phase == "correctness":
                st.reverted.append({"candidate": cand.to_dict(), "kept": len(kept), "retried": False,
                                    "outcome": outcome, "signature": sig.describe(), "key": sig.key()})
            self._record(sig, cand, outcome, before, trial)
            self._log(phase, trial, sig, cand, outcome, before=before)
        st.status = "met"
        st.phase = "performance"
        self._credit(kept, current)
        self._save()
        return current

    def _from_prior(self, kept: list[R.Candidate], current: Evaluation) -> Evaluation:
        """Try, as one step, every remedy of the passing configuration the playbook holds for this chip
        (Playbook.prior_config: the same family's first, else the newest) and keep them all when the
        judge keeps the step; the loop then goes on from there remedy by remedy. Only at the start of a
        bring-up (nothing kept yet). The performance phase later removes those this model does not need."""
        st = self.state
        config = None if kept else self.playbook.prior_config(self.info.chip, self.info.family)
        st.prior = {"model": None if config is None else config["model"]}
        if config is None:
            return current
        bundle = [_candidate(c) for c in config["kept"]]
        whole = R.Candidate("prior_configuration", tuple(r for c in bundle for r in c.rules),
                            f"start from {Path(config['model']).name}'s passing configuration on this chip "
                            f"({len(bundle)} remedies)")
        trial = self.evaluate(bundle)
        outcome = judge(current, trial)
        st.prior["outcome"] = outcome
        before = current
        if outcome in GOOD:
            kept.extend(bundle)
            current = trial
        sig = before.signature
        if sig is not None:
            self._record(sig, whole, outcome, before, trial)
        self._log("correctness (prior)", trial, sig, whole, outcome, before=before)
        return current

    def _credit(self, kept: list[R.Candidate], current: Evaluation) -> None:
        """Tell the playbook which kept remedies the passing configuration needs (`essential`) and which
        later ones override entirely (`superseded`), under the signature each was kept for."""
        found = {it["remedy"]["description"]: it["signature"] for it in self.state.iterations
                 if it.get("remedy") and it.get("signature") and it.get("outcome") in GOOD}
        for i, cand in enumerate(kept):
            sig = found.get(cand.description)
            if sig is None:  # not kept by this loop's correctness phase (a resumed older state)
                continue
            outcome = CREDIT[0] if self._differs(current, self.overrides(kept[:i] + kept[i + 1:])) else CREDIT[1]
            self.state.credit.append({"description": cand.description, "credit": outcome})
            self.playbook.record(Entry(signature=sig["key"], kind=sig["kind"], chip=self.info.chip,
                                       vendor=self.info.vendor, family=self.info.family, model=self.info.model,
                                       remedy=cand.remedy, candidate=cand.description, outcome=outcome))

    def _refuted(self, sig: Signature) -> Signature:
        """An accumulation signature whose strongest remedy, an fp32 accumulator, was tried under its
        key (the same narrow accumulator; the K-growth it measures moves from run to run) and changed
        nothing (or made it worse) is not accumulation: every other accumulation remedy (promote,
        split K, stochastic rounding) approximates that one. It is then the culprit matmul's op-class
        error (Hopper fp8 on SmolLM2: fp22 sums over K = 576 looked like accumulation; the per-tensor
        scale of o_proj's outlier input was the error)."""
        if isinstance(sig, Accumulation) and any(
                r.get("key") == sig.key() and r["candidate"]["remedy"] == "widen_accumulator"
                and r.get("outcome") in ("no_effect", "worse") for r in self.state.reverted):
            return OpClassError(op_class="matmul", op=sig.op, module=sig.module)
        return sig

    def _retry(self, kept: list[R.Candidate], current: Evaluation) -> list[R.Candidate]:
        """A reverted candidate, tried again once, when remedies kept since may have removed the larger
        error that hid its gain (Gemma 3 on Wormhole: exact exp in the attention lost to the bf16
        matmuls' error early and was what remained once the model was upcast). Most recent first."""
        keys = {c.key for c in kept}
        for r in reversed(self.state.reverted):
            cand = _candidate(r["candidate"])
            if not r["retried"] and r["kept"] < len(kept) and cand.key not in keys:
                r["retried"] = True
                if self.changes_numerics(cand, current):
                    return [cand]
        return []

    def _performance(self, kept: list[R.Candidate], current: Evaluation) -> Evaluation:
        """Newest kept remedy first: try without it; if the goal needs it, walk down its cheaper
        variants (closest first), keeping each that still meets the goal faster, and stop at the first
        that does not (the next ones are less accurate still)."""
        spent = 0
        for i in reversed(range(len(kept))):
            cand = kept[i]
            remedy = R.load_builtin().get(cand.remedy)
            ctx = R.RemedyContext(numerics=current.target.numerics, site=current.target.site_numerics)
            variants = [None] + (remedy.cheaper(cand, ctx) if remedy and remedy.cheaper else [])
            for v in variants:  # None: without it at all
                if spent >= self.cfg.perf_budget:
                    return current
                if v is None and self._kept_for(cand) == "op_not_lowered":
                    # without it the chip cannot compile the model: removing it would only show that again
                    self.state.skipped.append({"description": cand.description, "change": "remove",
                                               "predicted_ms": None, "current_ms": current.cost_ms,
                                               "why": "kept for an op the chip does not lower"})
                    continue
                trial_kept = kept[:i] + ([v] if v is not None else []) + kept[i + 1:]
                if v is not None and not self._differs(current, self.overrides(trial_kept),
                                                       self.overrides(kept[:i] + kept[i + 1:])):
                    # the variant sets what the chip does anyway (fp8 weights on an H100): removing it was tried
                    self.state.skipped.append({"description": v.description, "change": "cheapen",
                                               "predicted_ms": None, "current_ms": current.cost_ms,
                                               "why": "the same numerics as without it"})
                    continue
                priced = self.price(trial_kept, current)
                if priced is not None and current.cost_ms is not None and priced >= current.cost_ms - 1e-9:
                    # the spec says it saves nothing (e.g. a later rule overrides it): not worth a verify run
                    self.state.skipped.append({"description": (v or cand).description, "change": "remove" if v is None
                                               else "cheapen", "predicted_ms": priced, "current_ms": current.cost_ms})
                    continue
                trial = self.evaluate(trial_kept)
                spent += 1
                better = trial.met and trial.cost_ms is not None and current.cost_ms is not None \
                    and trial.cost_ms < current.cost_ms
                before = current
                if better:
                    kept[:] = trial_kept
                    current = trial
                self._log("performance", trial, None, v or cand, "cheaper" if better else "rejected", before=before,
                          change="remove" if v is None else "cheapen")
                if v is None and better:
                    break  # removed: nothing left of it to cheapen
                if v is not None and not better:
                    break  # a less accurate variant than this one fails too
        return current

    def _kept_for(self, cand: R.Candidate) -> str | None:
        """The kind of the signature `cand` was kept for in this loop's correctness phase, if it was."""
        return next((it["signature"]["kind"] for it in self.state.iterations if it.get("signature")
                     and (it.get("remedy") or {}).get("description") == cand.description
                     and it.get("outcome") in GOOD), None)

    def changes_numerics(self, cand: R.Candidate, current: Evaluation) -> bool:
        """Whether adding `cand` to the configuration `current` ran changes the numerics (or placement)
        of any site its run dispatched; with no sites to compare (it did not compile), assume it does."""
        return self._differs(current, current.target.overrides.plus(*cand.rules))

    def _differs(self, current: Evaluation, overrides: Overrides, than: Overrides | None = None) -> bool:
        """Whether `overrides` give any site `current`'s run dispatched other numerics than `than` does
        (default: `current`'s own configuration); with no sites to compare, assume they do."""
        sites = current.target.sites_seen()
        if not sites:
            return True
        a = EmulatedTarget(chip=self.cfg.chip, overrides=overrides, seed=self.cfg.seed)
        b = current.target if than is None else EmulatedTarget(chip=self.cfg.chip, overrides=than, seed=self.cfg.seed)
        return any(a.site_numerics(m, op) != b.site_numerics(m, op) for m, op in sites)

    def price(self, kept: list[R.Candidate], current: Evaluation) -> float | None:
        """The spec-predicted ms per request of `kept`, priced on the current run's trace (no model run);
        None when it cannot be priced that way (a change of what runs on the host changes the trace)."""
        from firstlight.targets.emulated_cost import predict

        model = current.target._model
        overrides = self.overrides(kept)

        def placement(rules: list[Any]) -> list[Any]:
            return [r for r in rules if r.fallback or r.decompose]

        if model is None or current.result is None or placement(overrides.rules) != placement(
                current.target.overrides.rules):
            return None
        trial = EmulatedTarget(chip=self.cfg.chip, overrides=overrides, seed=self.cfg.seed)
        pred = predict(model, trial.spec, trial.site_numerics, current.target.last_forward)
        return pred["prefill_ms"] + DECODE_TOKENS * pred["decode_step_ms"]

    # ---- records ------------------------------------------------------------------------------------
    def _record(self, sig: Signature, cand: R.Candidate, outcome: str, before: Evaluation, after: Evaluation) -> None:
        delta = after.cost_ms - before.cost_ms if after.cost_ms is not None and before.cost_ms is not None else None
        self.playbook.record(Entry(signature=sig.key(), kind=sig.kind, chip=self.info.chip, vendor=self.info.vendor,
                                   family=self.info.family, model=self.info.model, remedy=cand.remedy,
                                   candidate=cand.description, outcome=outcome, cost_ms=delta))

    def _log(self, phase: str, ev: Evaluation, sig: Signature | None, cand: R.Candidate | None,
             outcome: str | None = None, before: Evaluation | None = None, change: str | None = None) -> None:
        c = (ev.result or {}).get("culprit") or {}
        self.state.iterations.append({
            "run": self.runs, "phase": phase, "change": change, "seconds": round(ev.seconds, 2),
            "signature": sig.to_dict() if sig else None,
            "remedy": cand.to_dict() if cand else None, "outcome": outcome,
            "after": {"met": ev.met, "error": ev.error, "unmet": ev.unmet[:4], "metrics": ev.metrics(),
                      "timings_s": {k: round(v, 2) for k, v in ((ev.result or {}).get("timings_s") or {}).items()},
                      "signature": ev.signature.to_dict() if ev.signature else None,
                      "culprit": {k: c.get(k) for k in ("op", "module", "source")} if c else None,
                      "cost_ms": ev.cost_ms},
            "cost_delta_ms": (ev.cost_ms - before.cost_ms) if before and ev.cost_ms is not None
            and before.cost_ms is not None else None,
        })
        self._save()

    def _save(self) -> None:
        self.state.kept = [c.to_dict() for c in self.kept]
        self.state.overrides = self.overrides(self.kept).model_dump(exclude_none=True)
        self.state.save(self.cfg.out)
        self.on_iteration(self.state)


def _in_features(model: torch.nn.Module, module: str) -> int | None:
    try:
        m = model.get_submodule(module)
    except AttributeError:
        return None
    return getattr(m, "in_features", None)
