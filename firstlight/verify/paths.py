"""Serving paths on the target: prefill + decode through its own paged KV cache, batches, chunked prefill.

A server does not run one full-sequence forward. It prefills a prompt into a paged KV cache, then
decodes one token per step reading that cache; it batches prompts of different lengths (padding,
masks, block tables) and splits long prompts into chunks. Each of these runs here on the target as
the `prefill` / `decode` unit (units.StepAdapter: the model's own forward and KV-cache protocol over
a pool of slots, functional), and every logits row is compared with the reference's row for that
token. The reference needs no second generation: its full forward over the same tokens gives the
logits at every position (teacher forcing: the decode steps feed the reference's tokens), its K/V
and every boundary there.

    serve    B=3 rows of different lengths and content (the whole sequence, a suffix of it, a
             prefix of it), each row's prompt prefilled in chunks of `chunk_size` (a row that runs
             out is padded: position -1, writing a scratch slot), then `decode_steps` batched
             one-token steps, each row at its own position, reading the cache the target built
             (B=1, the sequence alone, with `batch_path=False`)

Block tables hand out blocks in a scrambled order, so a gather that ignores the table, or reads
across a block edge wrongly, reads another row's keys. Each step also compares the tables the
target builds for its (positions, key positions) with the reference's (tables.py), and the path
ends by comparing the target's whole K/V pool with the reference's K/V, per layer.

Hybrid models (Gated DeltaNet, Mamba-2 layers) also carry a recurrent state from step to step: each
batch row owns one state slot (conv inputs and recurrent state per recurrent layer, the engine's
layout: models/states.py `state_shapes`), zeros before its first token, passed to the step unit and returned
updated like the K/V pool (units.SlotStates). A recurrent mixer cannot skip padding tokens, so, as
the engine runs rows of different token counts as separate forwards, a chunk in which rows feed
different numbers of tokens runs as one forward per count (`uniform_rows`), the other rows padding
rows (position -1, the scratch state slot). The path ends by comparing each row's final state with
HF's state after the same tokens (its hybrid cache) and with the target's own one-shot prefill.

A failing step is localized like a failing full-sequence unit: each layer of that step runs as the
`decode_layer:<type>` unit on the reference's input at those positions, the reference's tables and
a pool holding the reference's K/V (`step_layer_unit`), or, for a recurrent layer, state slots holding
HF's state after each row's tokens before the step; the first layer over tolerance (its output, or
the K/V or state it writes) is replayed op by op (oplevel.py, `OpSite.phase` = the step's phase).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from firstlight.models.states import state_shapes
from firstlight.verify import units as U
from firstlight.verify.metrics import compare
from firstlight.verify.tables import ReferenceTables, Tables, compare_tables
from firstlight.verify.tolerance import TolerancePolicy


@dataclass
class RefSeq:
    """One reference sequence (HF, fp32): its tokens, boundary tensors [1, S, *] incl. logits, K/V per
    attention layer."""

    tokens: list[int]
    caps: dict[str, torch.Tensor]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # per attention layer: k, v [1, Hkv, S, D]
    target_logits: torch.Tensor | None = None  # [S, V]: the target's own full-sequence forward (`logits` unit)


# The reference's recurrent state of refs[r] after its first n >= 1 tokens: per recurrent layer,
# (conv inputs [C, K-1], recurrent state [...]) in fp32, shaped as the target keeps them.
RefStates = Callable[[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]]
STATE_PARTS = ("conv", "rec")  # a recurrent layer's states: conv inputs, recurrent state (SSM / delta rule)


class PageLayout:
    """Block tables for rows that each start at position 0: position p of row b lives in slot
    table[b][p // block_size] * block_size + p % block_size. Blocks are handed out in a scrambled
    order (seeded); the last slot is a scratch slot for padding tokens. Recurrent state: row b owns
    state slot b; slot `state_scratch` (the last) takes what padding rows write."""

    def __init__(self, lengths: list[int], block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        needed = [-(-n // block_size) for n in lengths]
        order = torch.randperm(sum(needed), generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: list[list[int]] = []
        for n in needed:
            self.tables.append(order[:n])
            order = order[n:]
        self.scratch = sum(needed) * block_size
        self.num_slots = self.scratch + 1
        self.num_keys = max(needed) * block_size  # L: every step gathers this many keys per row
        self.state_scratch = len(lengths)
        self.num_state_slots = len(lengths) + 1

    def slots(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(self.tables[row])
        bs = self.block_size
        real = positions >= 0
        p = positions.clamp(min=0)
        block = torch.where(p // bs < len(table), p // bs, 0)
        return torch.where(real, table[block] * bs + p % bs, self.scratch)

    def write_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """[B*S] pool slot of each new token ([B, S] positions; padding: the scratch slot)."""
        return torch.stack([self.slots(b, positions[b]) for b in range(positions.shape[0])]).reshape(-1)

    def gather(self, filled: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """gather_slots, key_positions [B, L] for rows holding `filled[b]` tokens (positions 0..n-1)."""
        j = torch.arange(self.num_keys)
        slots, keys = [], []
        for b, n in enumerate(filled):
            valid = j < n
            keys.append(torch.where(valid, j, -1))
            slots.append(torch.where(valid, self.slots(b, torch.where(valid, j, -1)), self.scratch))
        return torch.stack(slots), torch.stack(keys)


@dataclass
class Step:
    """One forward of a path: [B, S] tokens at their positions (-1: padding), one RefSeq per row."""

    phase: str
    ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    gather_slots: torch.Tensor
    key_positions: torch.Tensor
    rows: list[int]
    filled_before: list[int]  # tokens each row held in the cache before this step
    state_slots: torch.Tensor  # [B]: each row's recurrent state slot (padding rows: the scratch slot)

    @property
    def filled_after(self) -> list[int]:
        return [n + int((p >= 0).sum()) for n, p in zip(self.filled_before, self.positions, strict=True)]

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.positions, self.write_slots, self.gather_slots, self.key_positions

    def describe(self) -> dict[str, Any]:
        real = self.positions[self.positions >= 0]
        return {"phase": self.phase, "shape": list(self.ids.shape),
                "positions": [int(real.min()), int(real.max())] if real.numel() else None}


def _step(layout: PageLayout, phase: str, refs: list[RefSeq], rows: list[int], spans: list[tuple[int, int]],
          width: int) -> Step:
    """Row b feeds its tokens [spans[b][0], spans[b][1]) padded to `width` (token 0, position -1)."""
    ids, pos = [], []
    for r, (a, e) in zip(rows, spans, strict=True):
        n = max(0, e - a)
        ids.append(refs[r].tokens[a:a + n] + [0] * (width - n))
        pos.append(list(range(a, a + n)) + [-1] * (width - n))
    positions = torch.tensor(pos)
    filled_after = [max(a, e) for a, e in spans]
    gather_slots, key_positions = layout.gather(filled_after)
    state_slots = torch.tensor([b if e > a else layout.state_scratch for b, (a, e) in enumerate(spans)])
    return Step(phase, torch.tensor(ids), positions, layout.write_slots(positions), gather_slots, key_positions,
                list(rows), [a for a, _ in spans], state_slots)


def serve_plan(refs: list[RefSeq], rows: list[int], lengths: list[int], num_decode: int, chunk: int,
               block_size: int, uniform_rows: bool = False) -> tuple[PageLayout, list[Step]]:
    """Each row's first `length - num_decode` tokens prefilled in chunks of `chunk` (a row that runs
    out is padded), then `num_decode` batched one-token steps, each row at its own position.

    `uniform_rows` (hybrid models): no row holds padding tokens; a chunk whose rows feed different
    numbers of tokens runs as one forward per count, in which the other rows are padding rows."""
    layout = PageLayout(lengths, block_size, seed=1)
    prompt = [n - num_decode for n in lengths]
    steps = []
    for start in range(0, max(prompt), chunk):
        spans = [(min(start, p), min(start + chunk, p)) for p in prompt]
        if not uniform_rows:
            steps.append(_step(layout, "prefill", refs, rows, spans, chunk))
            continue
        for count in sorted({e - a for a, e in spans if e > a}, reverse=True):
            group = [(a, e) if e - a == count else (a, a) for a, e in spans]
            steps.append(_step(layout, "prefill", refs, rows, group, count))
    for d in range(num_decode):
        steps.append(_step(layout, "decode", refs, rows, [(p + d, p + d + 1) for p in prompt], 1))
    return layout, steps


# ---- running a path ------------------------------------------------------------------------------

@dataclass
class PathRun:
    """What a path run leaves behind for localization: the steps, the pool before each step."""

    name: str
    layout: PageLayout
    steps: list[Step]
    record: dict[str, Any]
    failing_step: int | None = None
    target_tables: list[Tables] = field(default_factory=list)


def _row_parity(tgt: torch.Tensor, ref: torch.Tensor, near_tie: float) -> dict[str, torch.Tensor]:
    """Per row of [N, V] logits: KL(ref || target), top-1 agreement, clear-margin flips, non-finite."""
    ref_lp = F.log_softmax(ref.double(), dim=-1)
    tgt_lp = F.log_softmax(tgt.double(), dim=-1)
    kl = (ref_lp.exp() * (ref_lp - tgt_lp)).sum(-1)
    top2 = ref_lp.topk(min(2, ref_lp.shape[-1]), dim=-1)
    margin = top2.values[:, 0] - top2.values[:, -1]
    finite = torch.isfinite(tgt).all(-1)
    agree = top2.indices[:, 0] == tgt.double().nan_to_num(nan=-math.inf).argmax(-1)
    kl = torch.where(finite, kl, torch.full_like(kl, math.inf))
    return {"kl": kl, "agree": agree & finite, "clear_flip": ~agree & (margin >= near_tie), "finite": finite,
            "margin": margin}


def _compare_step_logits(step: Step, logits: torch.Tensor, refs: list[RefSeq], dtype: torch.dtype,
                         policy: TolerancePolicy, path: str) -> dict[str, Any]:
    """Every real row of the step against its reference row; the step fails if any batch row's mean KL is
    over `max_mean_kl`, a top-1 flip has a clear reference margin, a value is not finite, or the rows
    differ from the target's own full-sequence forward at those tokens by more than the tensor
    tolerance (`<path>.logits`): a server's step must compute what the full forward computes. The
    last test is the sensitive one on a model whose distributions are peaked (a 1% logit error can
    leave the KL at 1e-13), and it does not inherit the target dtype's error against fp32."""
    tol = policy.logits
    rec: dict[str, Any] = step.describe()
    tgt_rows, ref_rows, self_rows, where = [], [], [], []
    for b, r in enumerate(step.rows):
        for s in range(step.positions.shape[1]):
            p = int(step.positions[b, s])
            if p >= 0:
                tgt_rows.append(logits[b, s])
                ref_rows.append(refs[r].caps["logits"][0, p])
                self_rows.append(refs[r].target_logits[p] if refs[r].target_logits is not None else ref_rows[-1])
                where.append((b, p))
    tgt, ref = torch.stack(tgt_rows).float(), torch.stack(ref_rows)
    par = _row_parity(tgt, ref, tol.near_tie_margin)
    m = compare(tgt, ref, dtype, policy.for_tensor(f"{path}.logits"))
    own = compare(tgt, torch.stack(self_rows).float(), dtype, policy.for_tensor(f"{path}.logits"))
    rows_kl = {}
    for k, (b, _) in enumerate(where):
        rows_kl.setdefault(b, []).append(float(par["kl"][k]))
    row_mean = {b: sum(v) / len(v) for b, v in rows_kl.items()}
    bad = [k for k, (b, _) in enumerate(where)
           if par["clear_flip"][k] or not par["finite"][k] or row_mean[b] > tol.max_mean_kl and par["kl"][k] > tol.max_mean_kl]
    worst_row = max(row_mean.values())
    rec.update(num_rows=len(where), mean_kl=_finite(float(par["kl"].mean())), max_kl=_finite(float(par["kl"].max())),
               max_row_mean_kl=_finite(worst_row), top1_agreement=float(par["agree"].double().mean()),
               num_clear_flips=int(par["clear_flip"].sum()), nonfinite_rows=int((~par["finite"]).sum()),
               rel_l2=m.to_dict()["rel_l2"], max_abs=m.to_dict()["max_abs"],
               vs_full_forward=own.to_dict(), ok=not bad and worst_row <= tol.max_mean_kl and own.ok)
    if not rec["ok"]:
        if bad:
            k = bad[0]
        elif not own.ok:  # the row that differs most from the full forward
            diff = (tgt.double() - torch.stack(self_rows).double()).norm(dim=-1).nan_to_num(nan=math.inf)
            k = int(diff.argmax())
        else:
            k = max(range(len(where)), key=lambda i: float(par["kl"][i]))
        b, p = where[k]
        rec["first_bad"] = {"row": b, "position": p, "kl": _finite(float(par["kl"][k])),
                            "ref_margin": float(par["margin"][k]), "clear_flip": bool(par["clear_flip"][k]),
                            "finite": bool(par["finite"][k])}
    return rec


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class StepRunner:
    """Compiles and runs step / tables units through the harness's compile wrapper, once per unit and
    input shapes (a compiling target compiles decode once, whatever the number of steps). `name`
    tells units apart: the compiled callable holds its unit's parameters."""

    def __init__(self, compile_fn: Callable[..., Any], tmodel: nn.Module, dtype: torch.dtype) -> None:
        self.compile_fn, self.tmodel, self.dtype = compile_fn, tmodel, dtype
        self._fns: dict[tuple, Callable[..., Any]] = {}
        self.state_layers: tuple[int, ...] = tuple(tmodel.config.state_layers)
        # one request's states in a recurrent layer (the engine's: conv inputs, recurrent state), the
        # same in every recurrent layer of a model
        specs = {tuple(state_shapes(tmodel, i)) for i in self.state_layers}
        assert len(specs) <= 1, f"recurrent layers keep states of different shapes: {specs}"
        self.state_specs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = specs.pop() if specs else ()

    def zero_states(self, num_slots: int, num_layers: int | None = None) -> tuple[torch.Tensor, ...]:
        """Zeroed state pools [num_layers (default: every recurrent layer), num_slots, ...] ((): no recurrent layer)."""
        n = len(self.state_layers) if num_layers is None else num_layers
        return tuple(torch.zeros((n, num_slots, *shape), dtype=dt) for shape, dt in self.state_specs)

    def _get(self, key: str, make: Callable[[], U.Unit], inputs: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
        k = (key, tuple((tuple(t.shape), t.dtype) for t in inputs))
        if k not in self._fns:
            self._fns[k] = self.compile_fn(make(), inputs)
        return self._fns[k]

    def step(self, step: Step, pool: torch.Tensor,
             states: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """One step through the K/V pool (and the state pools, hybrid models) → (logits, pool, states)."""
        inputs = (*step.inputs(), pool, *((step.state_slots, *states) if states else ()))
        logits, pool, *states = self._get(step.phase, lambda: U.step_unit(self.tmodel, step.phase), inputs)(*inputs)
        return logits, pool, tuple(states)

    def tables(self, positions: torch.Tensor, key_positions: torch.Tensor) -> Tables:
        inputs = (positions, key_positions)
        out = self._get("tables", lambda: U.tables_unit(self.tmodel, self.dtype), inputs)(*inputs)
        return Tables.from_unit(out, list(self.tmodel.inv_freq))

    def unit(self, key: str, make: Callable[[], U.Unit], inputs: tuple[torch.Tensor, ...]) -> Any:
        return self._get(key, make, inputs)(*inputs)


def run_path(name: str, layout: PageLayout, steps: list[Step], refs: list[RefSeq], runner: StepRunner,
             ref_tables: ReferenceTables, pool_shape: tuple[int, ...], policy: TolerancePolicy,
             ref_states: RefStates | None = None) -> PathRun:
    """Every step on the target through its own pool (and state slots: hybrid models, `ref_states`
    required); per-step logits and tables, then the K/V pool and each row's final state."""
    dtype = runner.dtype
    pool = torch.zeros((pool_shape[0], 2, layout.num_slots, *pool_shape[1:]), dtype=dtype)
    states = runner.zero_states(layout.num_state_slots)  # every row starts at position 0: zeros
    run = PathRun(name, layout, steps, {})
    records, tables_bad = [], []
    for k, step in enumerate(steps):
        logits, pool, states = runner.step(step, pool, states)
        rec = {"step": k, **_compare_step_logits(step, logits, refs, dtype, policy, name)}
        t_tab = runner.tables(step.positions, step.key_positions)
        run.target_tables.append(t_tab)
        rows = compare_tables(t_tab, ref_tables.tables(step.positions, step.key_positions), step.positions,
                              step.key_positions, dtype, policy, f"{name}[{k}]")
        bad = [r for r in rows if not r["ok"]]
        rec["tables_ok"] = not bad
        if bad:
            rec["ok"] = False
            tables_bad.append(bad[0])
        records.append(rec)
        if not rec["ok"] and run.failing_step is None:
            run.failing_step = k
    own_layout, own_pool, own_states = _one_shot_pool(steps, refs, runner, pool_shape, layout.block_size)
    kv_rows = _compare_pool(pool, layout, steps, refs, dtype, policy, name, own_layout, own_pool)
    kv_bad = next((r for r in kv_rows if not r["ok"]), None)
    run.record = {"name": name, "block_size": layout.block_size, "num_keys": layout.num_keys,
                  "rows": [{"ref": r, "length": n} for r, n in _row_lengths(steps)],
                  "ok": all(r["ok"] for r in records) and kv_bad is None,
                  "steps": records, "first_failing_step": run.failing_step,
                  "first_bad_table": tables_bad[0] if tables_bad else None,
                  "kv_cache": _summary(kv_rows)}
    if states:
        assert ref_states is not None, "a hybrid model's path needs the reference's states"
        state_rows = _compare_states(states, own_states, runner.state_layers, steps, ref_states, dtype, policy, name)
        run.record["state"] = _summary(state_rows)
        run.record["ok"] = run.record["ok"] and run.record["state"]["ok"]
    return run


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A cache check's verdict: ok, the first bad row, the largest rel L2 against the reference."""
    bad = next((r for r in rows if not r["ok"]), None)
    return {"ok": bad is None, "first_bad": bad,
            "max_rel_l2": max((r["rel_l2"] if r["rel_l2"] is not None else math.inf for r in rows), default=0.0)}


def _row_lengths(steps: list[Step]) -> list[tuple[int, int]]:
    last = steps[-1]
    return [(r, int(last.positions[b].max()) + 1) for b, r in enumerate(last.rows)]


def _one_shot_pool(steps: list[Step], refs: list[RefSeq], runner: StepRunner, pool_shape: tuple[int, ...],
                   block_size: int) -> tuple[PageLayout, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The K/V (and recurrent states) the target caches when it prefills every row's cached tokens in
    one step (hybrid models: one per row length): what its own full forward computes, to tell a cache
    the path corrupted from the target's own numerics."""
    lengths = _row_lengths(steps)
    layout, plan = serve_plan(refs, [r for r, _ in lengths], [n for _, n in lengths], 0, max(n for _, n in lengths),
                              block_size, uniform_rows=bool(runner.state_layers))
    pool = torch.zeros((pool_shape[0], 2, layout.num_slots, *pool_shape[1:]), dtype=runner.dtype)
    states = runner.zero_states(layout.num_state_slots)
    for step in plan:
        _, pool, states = runner.step(step, pool, states)
    return layout, pool, states


def _compare_pool(pool: torch.Tensor, layout: PageLayout, steps: list[Step], refs: list[RefSeq],
                  dtype: torch.dtype, policy: TolerancePolicy, path: str, own_layout: PageLayout,
                  own_pool: torch.Tensor) -> list[dict[str, Any]]:
    """The target's K/V for every token it cached, per layer, against the reference's (HF's cache) and
    against the target's own one-shot prefill of the same tokens. A layer fails only when it is off
    both: K/V within the tolerance of what the target's own forward computes carry its numerics
    (the error its hidden states accumulate over the layers before, which the logits checks judge),
    not a fault of the path's chunking, paging or cache."""
    rows = []
    lengths = _row_lengths(steps)
    for i in sorted(refs[0].kv):  # the attention layers
        for part, name in ((0, "k"), (1, "v")):
            tgt, ref, own = [], [], []
            for b, (r, n) in enumerate(lengths):
                pos = torch.arange(n)
                tgt.append(pool[i, part, layout.slots(b, pos)])  # [n, Hkv, D]
                own.append(own_pool[i, part, own_layout.slots(b, pos)])
                ref.append(refs[r].kv[i][part][0, :, :n].transpose(0, 1))
            tol = policy.for_tensor(f"{path}.kv.layers.{i}.{name}")
            m = compare(torch.cat(tgt), torch.cat(ref), dtype, tol).to_dict()
            o = compare(torch.cat(tgt), torch.cat(own), dtype, tol).to_dict()
            rows.append({"layer": i, "part": name, **m, "ok": m["ok"] or o["ok"], "vs_reference_ok": m["ok"],
                         "vs_one_shot_prefill": o})
    return rows


def _compare_states(states: tuple[torch.Tensor, ...], own_states: tuple[torch.Tensor, ...],
                    state_layers: tuple[int, ...], steps: list[Step], ref_states: RefStates, dtype: torch.dtype,
                    policy: TolerancePolicy, path: str) -> list[dict[str, Any]]:
    """Each row's final state, per recurrent layer and part, against HF's state after the row's tokens
    and against the target's own one-shot prefill of them (both layouts give row b slot b); a layer
    fails only when it is off both, as `_compare_pool` judges K/V."""
    rows = []
    lengths = _row_lengths(steps)
    ref = [ref_states(r, n) for r, n in lengths]
    for j, i in enumerate(state_layers):
        for part, name in enumerate(STATE_PARTS):
            tgt = states[part][j, :len(lengths)]
            own = own_states[part][j, :len(lengths)]
            want = torch.stack([ref[b][i][part] for b in range(len(lengths))])
            tol = policy.for_tensor(f"{path}.state.layers.{i}.{name}")
            m = compare(tgt.float(), want, dtype, tol).to_dict()
            o = compare(tgt.float(), own.float(), dtype, tol).to_dict()
            rows.append({"layer": i, "part": name, **m, "ok": m["ok"] or o["ok"], "vs_reference_ok": m["ok"],
                         "vs_one_shot_prefill": o})
    return rows


# ---- localizing a failing step --------------------------------------------------------------------

def _ref_rows(step: Step, refs: list[RefSeq], name: str) -> torch.Tensor:
    """The reference's boundary `name` at the step's positions, [B, S, *] (zeros at padding)."""
    out = []
    for b, r in enumerate(step.rows):
        src = refs[r].caps[name][0]
        idx = step.positions[b].clamp(min=0)
        out.append(torch.where((step.positions[b] >= 0)[:, None], src[idx], torch.zeros(())))
    return torch.stack(out)


def _ref_pool(layer: int, step: Step, layout: PageLayout, refs: list[RefSeq], num_slots: int) -> torch.Tensor:
    """One layer's pool [2, slots, Hkv, D] holding the reference's K/V of every token cached before the
    step (zeros for a layer without K/V: a Nemotron-H MLP block ignores its pool)."""
    kv = refs[step.rows[0]].kv
    k0 = kv[layer if layer in kv else min(kv)][0]
    pool = torch.zeros((2, num_slots, k0.shape[1], k0.shape[3]), dtype=torch.float32)
    for b, r in enumerate(step.rows):
        n = step.filled_before[b] if layer in kv else 0
        if n:
            slots = layout.slots(b, torch.arange(n))
            for part in (0, 1):
                pool[part, slots] = refs[r].kv[layer][part][0, :, :n].transpose(0, 1)
    return pool


def _state_rows(step: Step, layout: PageLayout) -> list[int]:
    """The batch rows of a step that feed tokens (the others are padding rows, on the scratch slot)."""
    return [b for b in range(len(step.rows)) if int(step.state_slots[b]) != layout.state_scratch]


def _ref_state_pools(layer: int, step: Step, layout: PageLayout, ref_states: RefStates,
                     runner: StepRunner) -> tuple[torch.Tensor, ...]:
    """One recurrent layer's state pools [slots, ...] (fp32) holding, in each real row's slot, HF's state
    after the row's tokens before the step (zeros for a row that starts there)."""
    pools = tuple(p[0].float() for p in runner.zero_states(layout.num_state_slots, 1))
    for b in _state_rows(step, layout):
        if step.filled_before[b]:
            for pool, t in zip(pools, ref_states(step.rows[b], step.filled_before[b])[layer], strict=True):
                pool[int(step.state_slots[b])] = t
    return pools


def _ref_new_states(layer: int, step: Step, layout: PageLayout, ref_states: RefStates) -> list[torch.Tensor]:
    """HF's states of one recurrent layer after the step, per part [N, ...] over the step's real rows."""
    after = [ref_states(step.rows[b], step.filled_after[b])[layer] for b in _state_rows(step, layout)]
    return [torch.stack([a[part] for a in after]) for part in range(len(STATE_PARTS))]


def _ref_new_kv(layer: int, step: Step, refs: list[RefSeq]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's K and V of the step's real tokens, [N, Hkv, D] each, in (row, position) order."""
    ks, vs = [], []
    for b, r in enumerate(step.rows):
        pos = step.positions[b][step.positions[b] >= 0]
        ks.append(refs[r].kv[layer][0][0, :, pos].transpose(0, 1))
        vs.append(refs[r].kv[layer][1][0, :, pos].transpose(0, 1))
    return torch.cat(ks), torch.cat(vs)


def _layer_cache_inputs(i: int, step: Step, layout: PageLayout, refs: list[RefSeq], runner: StepRunner,
                        ref_states: RefStates | None) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """What layer i's step unit caches, holding the reference's cache before the step, in the target's
    dtypes and in fp32: its state slots (a recurrent layer) or its write / gather slots and K/V pool."""
    if i in runner.state_layers:
        assert ref_states is not None, "localizing a hybrid model's step needs the reference's states"
        pools = _ref_state_pools(i, step, layout, ref_states, runner)
        cast = tuple(p.to(dt) for p, (_, dt) in zip(pools, runner.state_specs, strict=True))
        return (step.state_slots, *cast), (step.state_slots, *pools)
    pool = _ref_pool(i, step, layout, refs, layout.num_slots)
    slots = (step.write_slots, step.gather_slots)
    return (*slots, pool.to(runner.dtype)), (*slots, pool)


@dataclass
class StepLocalization:
    units: list[dict[str, Any]]  # per unit of the step: isolated metrics (output, K, V or conv, rec states)
    failing: str | None  # "embed" | "layers.i" | "head"
    replay_unit: U.Unit | None = None
    inputs_t: tuple[torch.Tensor, ...] = ()
    inputs_r: tuple[torch.Tensor, ...] = ()


def isolate_step(run: PathRun, k: int, refs: list[RefSeq], runner: StepRunner, ref_tables: ReferenceTables,
                 policy: TolerancePolicy, ref_states: RefStates | None = None) -> StepLocalization:
    """Each unit of step `k` on the target with the reference's inputs (a recurrent layer: HF's state
    before the step, from `ref_states`, required for hybrid models); the first one over tolerance."""
    step, tmodel, dtype = run.steps[k], runner.tmodel, runner.dtype
    real = step.positions >= 0
    phase = step.phase
    r_tab = ref_tables.tables(step.positions, step.key_positions)
    units: list[dict[str, Any]] = []

    def judge(name: str, out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
        return compare(out.float(), ref, dtype, policy.for_tensor(name)).to_dict()

    emb = runner.unit(f"{phase}_embed", lambda: _keyed(U.embed_unit(tmodel), f"{phase}_embed"), (step.ids,))
    row = {"unit": "embed", "output": judge("embed", emb[real], _ref_rows(step, refs, "embed")[real])}
    row["ok"] = row["output"]["ok"]
    units.append(row)
    if not row["ok"]:
        unit = _keyed(U.embed_unit(tmodel), f"{phase}_embed")
        return StepLocalization(units, "embed", unit, (step.ids,), (step.ids,))
    n = len(tmodel.layers)
    for i in range(n):
        t = tmodel.layers[i].layer_type
        x_ref = _ref_rows(step, refs, "embed" if i == 0 else f"layers.{i - 1}")
        cos_r, sin_r = r_tab.rope[t]
        mask = r_tab.masks[t]
        cached_t, cached_r = _layer_cache_inputs(i, step, run.layout, refs, runner, ref_states)
        inputs_t = (x_ref.to(dtype), cos_r.to(dtype), sin_r.to(dtype), mask, *cached_t)
        inputs_r = (x_ref, cos_r, sin_r, mask, *cached_r)
        key = f"{phase}_layer:{t}"
        out, *cached = runner.unit(f"{key}@layers.{i}", lambda i=i: U.step_layer_unit(tmodel, i, phase), inputs_t)
        row = {"unit": f"layers.{i}",
               "output": judge(f"layers.{i}", out[real], _ref_rows(step, refs, f"layers.{i}")[real])}
        if i in runner.state_layers:  # the states it writes into the real rows' slots
            slots = step.state_slots[_state_rows(step, run.layout)]
            for part, want in enumerate(_ref_new_states(i, step, run.layout, ref_states)):
                row[STATE_PARTS[part]] = judge(f"layers.{i}.{STATE_PARTS[part]}", cached[part][slots], want)
        elif i in refs[step.rows[0]].kv:  # the K/V it writes
            k_ref, v_ref = _ref_new_kv(i, step, refs)
            written = step.write_slots.view(step.positions.shape)[real]
            row["k"] = judge(f"layers.{i}.k", cached[0][0, written], k_ref)
            row["v"] = judge(f"layers.{i}.v", cached[0][1, written], v_ref)
        row["ok"] = all(m["ok"] for name, m in row.items() if name != "unit")
        units.append(row)
        if not row["ok"]:
            return StepLocalization(units, f"layers.{i}", U.step_layer_unit(tmodel, i, phase), inputs_t, inputs_r)
    x_ref = _ref_rows(step, refs, f"layers.{n - 1}")
    unit_key = f"{phase}_head"
    h, logits = runner.unit(unit_key, lambda: _keyed(U.head_unit(tmodel), unit_key), (x_ref.to(dtype),))
    row = {"unit": "head", "output": judge("norm", h[real], _ref_rows(step, refs, "norm")[real]),
           "logits": judge("logits", logits[real], _ref_rows(step, refs, "logits")[real])}
    row["ok"] = row["output"]["ok"] and row["logits"]["ok"]
    units.append(row)
    if not row["ok"]:
        return StepLocalization(units, "head", _keyed(U.head_unit(tmodel), unit_key), (x_ref.to(dtype),), (x_ref,))
    return StepLocalization(units, None)


def _keyed(unit: U.Unit, key: str) -> U.Unit:
    """The same unit under another key (and so phase): `decode_embed`, `decode_head`."""
    from firstlight.targets.base import unit_phase

    unit.key, unit.phase = key, unit_phase(key)
    return unit
