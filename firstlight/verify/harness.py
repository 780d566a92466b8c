"""`run_verify`: reference vs target, boundary by boundary, logits, then the op that breaks it.

    1. reference (HF, fp32): greedy continuation of the prompt (or its cached tokens, refcache.py);
       one forward over prompt + continuation with boundary hooks (one fp32 tensor per boundary,
       not every op)
    2. target: the whole model compiled once → logits (teacher-forced parity, greedy divergence,
       perplexity); boundaries in propagate mode (hooks, or a chain of compiled units)
    3. every unit (embed, each layer, head; for targets without hooks also each layer's
       attention and MLP) run on the target with the *reference* input: the first unit over
       tolerance is the failing one (isolated, so error inherited from earlier layers is not
       blamed on it). A unit whose propagated input already has the reference's bits is not run
       again: its propagated output is its isolated one (units are deterministic).
    4. that one unit replayed op by op (oplevel.py) → culprit ATen op, module path, source line;
       only that unit's fp32 reference weights are copied, never a second model
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from firstlight.models.config import ModelConfig
from firstlight.models.hf_names import hf_module_name, hf_name
from firstlight.models.loader import load_config, load_model, load_tokenizer, model_class
from firstlight.targets.base import Target, TargetError
from firstlight.verify import units as U
from firstlight.verify.longrange import perplexity_check
from firstlight.verify.metrics import compare
from firstlight.verify.nonfinite import first_nonfinite, json_safe
from firstlight.verify.oplevel import culprit, replay
from firstlight.verify.parity import ppl_token_count, teacher_forced
from firstlight.verify.paths import PathRun, RefSeq, RefStates, StepRunner, isolate_step, run_path, serve_plan
from firstlight.verify.refcache import ContinuationCache, ReferenceCacheWarning, continuation_key
from firstlight.verify.tables import ReferenceTables, Tables, compare_scales, compare_tables
from firstlight.verify.tolerance import TolerancePolicy

DEFAULT_PROMPT = "The capital of France is Paris. The quick brown fox jumps over the lazy dog. To be, or not to be,"


@dataclass
class VerifyConfig:
    new_tokens: int = 16  # reference greedy continuation (the free-running check)
    top_k: int = 5
    ppl_tokens: int = 256  # 0 disables perplexity
    ppl_window: int = 128
    ppl_stride: int = 64
    seed: int = 0
    decode_steps: int = 2  # serving path: chunked prefill, then this many one-token steps through the KV cache
    batch_path: bool = True  # serving path over 3 prompts of different lengths (False: the sequence alone)
    block_size: int = 16  # KV-cache block size of the serving paths (the engine's default)
    chunk_size: int = 20  # chunked-prefill chunk (not a multiple of block_size: chunks straddle block edges)


@dataclass
class VerifyResult:
    verdict: str  # "match" | "mismatch"
    model: str
    target: str
    dtype: str
    tokens: list[int]
    prompt_len: int
    boundaries: list[dict[str, Any]]  # per boundary: name, isolated + propagated metrics
    first_failing: dict[str, Any] | None
    ops: list[dict[str, Any]]
    culprit: dict[str, Any] | None
    parity: dict[str, Any]
    perplexity: dict[str, Any] | None
    target_report: dict[str, Any]
    tolerance: dict[str, Any]
    timings_s: dict[str, float]
    reasons: list[str] = field(default_factory=list)
    isolated_reused: list[str] = field(default_factory=list)  # units whose propagated input was bit-exact
    reference_continuation: dict[str, Any] = field(default_factory=dict)  # source: generated | cache | none
    tables: list[dict[str, Any]] = field(default_factory=list)  # rotary tables, masks, scales vs the reference's
    paths: dict[str, Any] = field(default_factory=dict)  # serving paths: decode, batch (paths.py)
    long_range: dict[str, Any] | None = None  # where a long-range-only divergence starts, which unit shows it
    first_nonfinite: dict[str, Any] | None = None  # where the first NaN / inf appears (unit, op)

    def to_dict(self) -> dict[str, Any]:
        """Strict JSON: non-finite floats become null."""
        return json_safe(dict(self.__dict__))


class _Timer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def __call__(self, name: str) -> Any:
        timer = self

        class _Ctx:
            def __enter__(self) -> None:
                self.t0 = time.perf_counter()

            def __exit__(self, *exc: object) -> None:
                timer.times[name] = timer.times.get(name, 0.0) + time.perf_counter() - self.t0

        return _Ctx()


def load_reference(path: str | Path) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()


def reference_params(unit: U.Unit, reference: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 reference weights of one unit, by the unit adapter's parameter names.

    Read straight from the HF reference's state dict (fused projections concatenated as the loader
    does), so localizing one layer copies that layer's weights only, never a twin of the model.
    """
    hf_state = reference.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name in unit.param_names:
        module, _, leaf = name.rpartition(".")
        ours = ".".join(p for p in (unit.model_path(module), leaf) if p)
        parts = [n if n in hf_state else "model.embed_tokens.weight"  # tied lm_head
                 for n in hf_name(ours, reference.config.model_type)]
        tensors = [hf_state[n].float() for n in parts]
        out[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    return out


class _Compiled:
    """Compiles units through the target (one artifact per key for compiling targets) with errors named."""

    def __init__(self, target: Target, spec: str) -> None:
        self.target, self.spec = target, spec

    def compile(self, unit: U.Unit, inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        # Detached: fresh tensor objects that are not the module's own parameters, so a compiler
        # cannot specialize on their identity (Dynamo would guard on `param is args[k]` and
        # recompile for every layer) and the units of one key share one artifact.
        params = [p.detach() for p in unit.params()]
        args = (*inputs, *params)
        try:
            fn = self.target.compile(unit, args, unit.key)
        except TargetError:
            raise
        except Exception as e:  # the target's own code: every failure means "could not compile"
            raise TargetError(f"target '{self.spec}' failed to compile unit '{unit.key}': {type(e).__name__}: {e}") from e

        def run(*xs: torch.Tensor) -> Any:
            try:
                return fn(*xs, *params)
            except TargetError:
                raise
            except Exception as e:
                raise TargetError(f"target '{self.spec}' failed running unit '{unit.key}': {type(e).__name__}: {e}") from e

        return run


# A cached token that the reference's own full-forward argmax rejects by more than this (nats) marks
# the entry stale. Generation (KV-cache decode) and the full forward differ by ~5e-5 in fp32 logits
# (SmolLM2-135M), so an honest entry only disagrees at near-exact ties, far below this.
STALE_MARGIN = 0.05


def _greedy(ref: nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    """The reference's greedy continuation (HF `generate`, KV cache): `new_tokens` sequential decode steps."""
    out = ref.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[0].tolist()[len(ids):]


def _reference_forward(ref: nn.Module, tokens: list[int], num_layers: int, mid: str,
                       sub_inputs: bool) -> dict[str, torch.Tensor]:
    """One forward over `tokens` with boundary hooks: one fp32 tensor per boundary, the logits, and
    what HF's cache holds after it (`_cached`)."""
    store: dict[str, torch.Tensor] = {}
    resolve = partial(hf_module_name, model_type=ref.config.model_type)
    cache = _hf_cache(ref)
    with U.capture(ref, store, resolve, layers=num_layers, mid_norm=mid, sub_inputs=sub_inputs):
        store["logits"] = ref(torch.tensor([tokens]), cache=cache, use_cache=True).logits.detach().float()
    store.update(_cached(cache, num_layers))
    return store


def _hf_cache(ref: nn.Module) -> Any:
    """An empty HF cache. A hybrid model's is built from its config (K/V or recurrent states, by layer
    kind); any other's without, so every layer keeps every key (the serving paths read them all)."""
    from transformers import DynamicCache

    return DynamicCache(config=ref.config) if is_hybrid(ref.config) else DynamicCache()


def _cached(cache: Any, num_layers: int) -> dict[str, torch.Tensor]:
    """What an HF cache holds per layer, fp32: an attention layer's K (after norm and rotary) and V as
    `kv.i.k`, `kv.i.v` [1, Hkv, S, D]; a recurrent layer's states as `state.i.conv`, the last K-1 conv
    inputs [1, C, K-1] (HF keeps K, the oldest of which no later token reads), and `state.i.rec`
    [1, ...] (Gated DeltaNet [Hv, Dk, Dv], Mamba-2 [H, P, N])."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    out = {}
    for i, layer in enumerate(cache.layers[:num_layers]):
        if isinstance(layer, LinearAttentionLayer):
            out[f"state.{i}.conv"] = layer.conv_states[0][..., 1:].detach().float()
            out[f"state.{i}.rec"] = layer.recurrent_states[0].detach().float()
        elif isinstance(layer, DynamicLayer):
            out[f"kv.{i}.k"], out[f"kv.{i}.v"] = layer.keys.detach().float(), layer.values.detach().float()
    return out


def is_hybrid(config: Any) -> bool:
    """A model with layers that are not attention (linear attention, SSM): they carry recurrent state."""
    types = getattr(config, "layer_types", None) or []
    return any(t not in ("full_attention", "sliding_attention") for t in types)


def _stale_position(logits: torch.Tensor, tokens: list[int], prompt_len: int) -> int | None:
    """First continuation position whose token the reference's argmax beats by > STALE_MARGIN (logits: [S, V])."""
    lp = torch.log_softmax(logits[prompt_len - 1:-1].double(), dim=-1)
    cont = torch.tensor(tokens[prompt_len:])
    gap = lp.max(dim=-1).values - lp.gather(-1, cont[:, None]).squeeze(-1)
    bad = (gap > STALE_MARGIN).nonzero().flatten().tolist()
    return prompt_len + bad[0] if bad else None


def _reference_pass(ref: nn.Module, model_path: str | Path, ids: list[int], num_layers: int, mid: str, new_tokens: int,
                    sub_inputs: bool = False, cache: ContinuationCache | None = None,
                    ) -> tuple[list[int], dict[str, torch.Tensor], dict[str, Any]]:
    """Greedy continuation (from `cache` when it has it), then the hooked forward over prompt + continuation.

    Returns (tokens, boundary tensors, provenance of the continuation for result.json). The hooked
    forward runs whatever the source of the tokens, so the reference tensors depend on the tokens only.
    """
    # cache: disabled | unused (no continuation) | miss | hit | unusable | stale; stored: written this run
    info: dict[str, Any] = {"new_tokens": new_tokens, "source": "generated" if new_tokens else "none",
                            "cache": "disabled" if cache is None else "miss", "cache_entry": None, "stored": False}
    if not new_tokens:
        info["cache"] = "unused" if cache is not None else "disabled"
        return list(ids), _reference_forward(ref, ids, num_layers, mid, sub_inputs), info
    key = None
    if cache is not None:
        key = continuation_key(model_path, ids, new_tokens)
        info["cache_entry"] = str(cache.entry_path(key))
        cont, problem = cache.load(key, int(ref.config.vocab_size))
        if problem:
            info["cache"] = "unusable"
            _warn_cache(info, problem)
        if cont is not None:
            tokens = list(ids) + cont
            store = _reference_forward(ref, tokens, num_layers, mid, sub_inputs)
            stale = _stale_position(store["logits"][0], tokens, len(ids))
            if stale is None:
                info.update(source="cache", cache="hit")
                return tokens, store, info
            info["cache"] = "stale"
            _warn_cache(info, f"reference cache entry {info['cache_entry']} is stale (token at position {stale} is "
                              f"not the reference's greedy choice); ignored, regenerating")
            cache.discard(key)
    tokens = list(ids) + _greedy(ref, ids, new_tokens)
    store = _reference_forward(ref, tokens, num_layers, mid, sub_inputs)
    if cache is not None and key is not None:
        problem = cache.store(key, tokens[len(ids):])
        info["stored"] = problem is None
        if problem:
            _warn_cache(info, problem)
    return tokens, store, info


def _warn_cache(info: dict[str, Any], message: str) -> None:
    warnings.warn(message, ReferenceCacheWarning, stacklevel=3)
    info.setdefault("warnings", []).append(message)


@torch.no_grad()
def run_verify(
    model_path: str | Path,
    target: Target,
    target_spec: str,
    prompt_ids: list[int] | None = None,
    config: VerifyConfig | None = None,
    policy: TolerancePolicy | None = None,
    ppl_ids: list[int] | None = None,
    reference: nn.Module | None = None,
    model: nn.Module | None = None,
    reference_cache: ContinuationCache | None = None,
) -> VerifyResult:
    """Verify `target` against the HF reference of the checkpoint at `model_path`.

    `reference` (the HF fp32 model) and `model` (ours, already in `target.dtype`) may be passed
    in already loaded; `model` is handed to `target.prepare`, so pass a fresh one per call.
    `reference_cache` (e.g. `ContinuationCache.default()`) reuses the reference's greedy
    continuation across runs (refcache.py); None generates it every time. A passed `reference`
    must be `load_reference(model_path)`: the cache is keyed by the checkpoint's files.
    """
    cfg_v = config or VerifyConfig()
    policy = policy or TolerancePolicy.for_dtype(target.tolerance_dtype)
    timer = _Timer()
    torch.manual_seed(cfg_v.seed)
    cfg = load_config(model_path)
    with timer("load"):
        ref = reference if reference is not None else load_reference(model_path)
        if model is not None:
            tmodel, tok = model, (load_tokenizer(model_path) if prompt_ids is None else None)
        else:
            tmodel, tok = load_model(model_path, target.dtype, with_tokenizer=prompt_ids is None)
    if prompt_ids is None:
        prompt_ids = tok(DEFAULT_PROMPT)["input_ids"]
    if len(prompt_ids) < 2:
        raise TargetError("the prompt must have at least 2 tokens")
    mid = U.mid_norm_name(tmodel.layers[0])
    num_layers = cfg.num_layers
    with timer("reference"):
        tokens, ref_caps, continuation = _reference_pass(ref, model_path, prompt_ids, num_layers, mid, cfg_v.new_tokens,
                                                         sub_inputs=not target.supports_hooks, cache=reference_cache)
    seq = torch.tensor([tokens])
    positions = torch.arange(seq.shape[1])[None]
    dtype = target.dtype

    with timer("compile"):
        try:
            tmodel = target.prepare(tmodel) or tmodel
        except TargetError:
            raise
        except Exception as e:
            raise TargetError(f"target '{target_spec}' failed to prepare the model: {type(e).__name__}: {e}") from e
        comp = _Compiled(target, target_spec)
        runner = StepRunner(comp.compile, tmodel, dtype)
        whole = comp.compile(U.logits_unit(tmodel), (seq,))
        embed_fn = comp.compile(U.embed_unit(tmodel), (seq,))
        ref_tables = ReferenceTables(ref, list(cfg.layer_types))
        r_tab32 = ref_tables.tables(positions, positions)
        r_tab = r_tab32.cast(dtype)  # the isolated units' tables: the reference's, in the target dtype
        x0 = ref_caps["embed"].to(dtype)
        layer_fns = []
        for i in range(num_layers):
            layer_fns.append(comp.compile(U.layer_unit(tmodel, i), (x0, *r_tab.inputs(tmodel.layers[i].layer_type))))
        head_fn = comp.compile(U.head_unit(tmodel), (x0,))
        # Compiled units hide the inside of a layer: its mixer and FFN modules get units of their own.
        sub_fns = None if target.supports_hooks else [
            (comp.compile(U.attention_unit(tmodel, i), (x0, *r_tab.inputs(tmodel.layers[i].layer_type)))
             if U.mixer_sub(tmodel.layers[i]) else None,  # a Nemotron-H MLP or MoE block has no token mixer
             {f: comp.compile(U.mlp_unit(tmodel, i, f), (x0,)) for f in U.ffn_subs(tmodel.layers[i])})
            for i in range(num_layers)]

    with timer("tables"):
        t_tab = runner.tables(positions, positions)  # what the target builds, and feeds its own layers
        table_rows = compare_tables(t_tab, r_tab32, positions, positions, dtype, policy, "sequence")
        span = max(seq.shape[1], cfg_v.ppl_window if cfg_v.ppl_tokens and ppl_ids else 0)
        if span > seq.shape[1]:  # every position perplexity feeds too
            long_pos = torch.arange(span)[None]
            table_rows += compare_tables(runner.tables(long_pos, long_pos), ref_tables.tables(long_pos, long_pos),
                                         long_pos, long_pos, dtype, policy, f"positions 0..{span - 1}")
        table_rows.append(compare_scales(tmodel, ref))
    bad_table = next((r for r in table_rows if not r["ok"]), None)

    prop: dict[str, torch.Tensor] = {}
    head_logits = None
    with timer("target"):
        if target.supports_hooks:
            with U.capture(tmodel, prop, layers=num_layers, mid_norm=mid):
                prop["logits"] = whole(seq).detach().float()
        else:
            prop["logits"] = whole(seq).detach().float()
            x = embed_fn(seq)
            prop["embed"] = x.float()
            for i, fn in enumerate(layer_fns):
                x = fn(x, *t_tab.inputs(tmodel.layers[i].layer_type))
                prop[f"layers.{i}"] = x.float()
            h, head_logits = head_fn(x)
            prop["norm"] = h.float()
            head_logits = head_logits.float()

    iso: dict[str, torch.Tensor] = {}
    with timer("isolate"):
        same = {t: t_tab.same_as(r_tab, t) for t in r_tab.rope}
        reused = _isolate(tmodel, embed_fn, seq, layer_fns, head_fn, ref_caps, prop, head_logits, iso, r_tab, same,
                          dtype, mid if target.supports_hooks else None)
        if sub_fns is not None:
            _isolate_sub_layers(tmodel, sub_fns, ref_caps, iso, r_tab, dtype)

    with timer("compare"):
        names = U.boundary_names(tmodel, resid_mid=target.supports_hooks)
        boundaries = _compare_boundaries(names, iso, prop,
                                         ref_caps, dtype, policy)
    # The first boundary over tolerance (sub-layer ones too: a fault a later norm hides is still a
    # fault), reported as the unit that contains it.
    bad = next((b["name"] for b in boundaries if "isolated" in b and not b["isolated"]["ok"]), None)
    failing = None if bad is None else (".".join(bad.split(".")[:2]) if bad.startswith("layers.") else bad)

    with timer("parity"):
        parity = teacher_forced(ref_caps["logits"][0], prop["logits"][0], tokens, len(prompt_ids), cfg_v.top_k, policy.logits)
    ppl = None
    if cfg_v.ppl_tokens and ppl_ids:
        with timer("perplexity"):
            ppl = _perplexity(ref, comp, tmodel, ppl_ids, cfg_v, policy)

    ops: list[dict[str, Any]] = []
    found = None
    first = None
    if failing is not None:
        with timer("localize"):
            first, ops, found = _localize(failing, tmodel, ref, cfg, ref_caps, seq, r_tab32, target, policy)
    elif bad_table is not None:
        first = {"unit": "tables", "table": bad_table["name"], "path": bad_table["path"],
                 "first_bad_position": bad_table.get("first_bad_position"),
                 "note": "the target's table differs from the reference's; every unit is within tolerance on the "
                         "reference's table, so the error is the table's, not how the target compiled a unit"}

    with timer("paths"):
        paths = _serving_paths(ref, tokens, ref_caps, prop["logits"][0], comp, tmodel, runner, ref_tables, cfg, cfg_v,
                               policy, num_layers, mid, not target.supports_hooks)
    if first is None:
        for name, (rec, loc_args) in paths.items():
            if loc_args is None:
                if first is None and rec.get("localization", {}).get("failing_unit") == "tables":
                    t = rec["localization"]["table"]
                    first = {"unit": "tables", "table": t["name"], "path": name, "step": rec["first_failing_step"],
                             "first_bad_position": t.get("first_bad_position"), "first_bad": t.get("first_bad"),
                             "note": f"the table the target built for the {name} path's step differs from the "
                                     "reference's; the step is not replayed op by op"}
                continue
            with timer("localize"):  # op replay for the first failing path only (its culprit is the result's)
                loc = _localize_step(*loc_args, ref=ref, target=target, policy=policy, replay_ops=first is None)
            rec["localization"] = loc["summary"]
            if first is None:
                first, ops, found = loc["first"], loc["ops"], loc["culprit"]
    path_records = {name: rec for name, (rec, _) in paths.items()}

    long_range = None
    if ppl is not None and not ppl["ok"] and ppl.get("first_divergence") and failing is None:
        with timer("long_range"):
            long_range = _long_range(ppl["first_divergence"], ppl_ids, ref, comp, runner, ref_tables, tmodel, cfg,
                                     target, policy, mid)

    reasons = list(parity.reasons)
    if bad_table is not None:
        where = f" from position {bad_table['first_bad_position']}" if bad_table.get("first_bad_position") is not None else ""
        reasons.insert(0, f"table {bad_table['name']} ({bad_table['path']}) differs from the reference's{where}")
    if failing is not None:
        reasons.insert(0, f"{bad}: isolated error over tolerance")
    if ppl is not None and not ppl["ratio_ok"]:
        r = ppl["ratio"]
        reasons.append(f"perplexity ratio {r:.4f} outside [{ppl['allowed_ratio'][0]:.4f}, {ppl['allowed_ratio'][1]:.4f}] "
                       f"({ppl['direction']} than the reference's)" if r is not None
                       else "perplexity is not finite on the target")
    if ppl is not None and ppl["ratio_ok"] and not ppl["kl_ok"]:
        reasons.append(f"perplexity text: mean KL {ppl['mean_kl']} > {ppl['kl_limit']}")
    if long_range is not None and long_range.get("first_unit"):
        reasons.append(f"long range: divergence starts at position {long_range['first_position']} of window "
                       f"{long_range['window']}; first shown by {long_range['first_unit']} ({long_range['mode']})")
    for name, rec in path_records.items():
        if not rec["ok"]:
            reasons.append(_path_reason(name, rec))
    rep = target.report().to_dict()
    result = VerifyResult(
        verdict="match" if not reasons else "mismatch",
        model=str(model_path), target=target_spec, dtype=str(dtype).removeprefix("torch."),
        tokens=tokens, prompt_len=len(prompt_ids), boundaries=boundaries, first_failing=first,
        ops=ops, culprit=found, parity=parity.to_dict(), perplexity=ppl, target_report=rep,
        tolerance=policy.to_dict(), timings_s=timer.times, reasons=reasons, isolated_reused=reused,
        reference_continuation=continuation, tables=table_rows, paths=path_records, long_range=long_range,
    )
    result.first_nonfinite = first_nonfinite(result)
    if result.first_nonfinite is not None:
        nf = result.first_nonfinite
        reasons.insert(0, f"first non-finite value: {nf['where']}" + (f", op {nf['op']}" if nf.get("op") else ""))
        result.verdict = "mismatch"
    return result


def _isolate(tmodel: nn.Module, embed_fn: Callable[..., Any], seq: torch.Tensor, layer_fns: list[Callable[..., Any]],
             head_fn: Callable[..., Any],
             ref_caps: dict[str, torch.Tensor], prop: dict[str, torch.Tensor], head_logits: torch.Tensor | None,
             iso: dict[str, torch.Tensor], r_tab: Tables, same_tables: dict[str, bool], dtype: torch.dtype,
             mid: str | None) -> list[str]:
    """Every unit on the target with the reference's input and tables → `iso`; the units it did not need to run.

    A unit whose propagated input has the same bits as the reference input (cast to the target
    dtype), and whose layer type's tables as the target built them are the reference's bits
    (`same_tables`), got exactly the isolated inputs already, so its propagated outputs are reused:
    units are deterministic (a contract of Target), and a target with hooks runs the same modules
    (and tables) in the whole model as in its units. So only the units from the first divergence on
    run again.
    """
    n = len(layer_fns)
    reused: list[str] = []
    # the embedding's input is the token ids on both sides
    embed = prop["embed"] if "embed" in prop else embed_fn(seq).float()
    hooks = U.capture(tmodel, iso, layers=n, mid_norm=mid) if mid is not None else _null()
    with hooks:
        for i, fn in enumerate(layer_fns):
            x_in = (ref_caps["embed"] if i == 0 else ref_caps[f"layers.{i - 1}"]).to(dtype)
            p_in = embed if i == 0 else prop.get(f"layers.{i - 1}")
            layer = tmodel.layers[i]
            sub = (*U.layer_subs(layer), *(("resid_mid",) if U.has_resid_mid(layer) else ())) if mid is not None else ()
            names = [f"layers.{i}", *(f"layers.{i}.{s}" for s in sub)]
            t = tmodel.layers[i].layer_type
            if (p_in is not None and same_tables[t] and all(k in prop for k in names)
                    and torch.equal(p_in, x_in.float())):
                iso.update({k: prop[k] for k in names})
                reused.append(f"layers.{i}")
                continue
            iso[f"layers.{i}"] = fn(x_in, *r_tab.inputs(t)).float()
        x_in = ref_caps[f"layers.{n - 1}"].to(dtype)
        logits = prop["logits"] if mid is not None else head_logits
        p_in = prop.get(f"layers.{n - 1}")
        if logits is not None and "norm" in prop and p_in is not None and torch.equal(p_in, x_in.float()):
            iso["norm"], iso["logits"] = prop["norm"], logits
            reused.append("head")
        else:
            h, logits = head_fn(x_in)
            iso["norm"], iso["logits"] = h.float(), logits.float()
    iso["embed"] = embed  # the layer-0 pre-hook wrote the reference input there
    return reused


def _isolate_sub_layers(tmodel: nn.Module,
                        sub_fns: list[tuple[Callable[..., Any] | None, dict[str, Callable[..., Any]]]],
                        ref_caps: dict[str, torch.Tensor], iso: dict[str, torch.Tensor], r_tab: Tables,
                        dtype: torch.dtype) -> None:
    """Mixer and FFN units of every layer on the reference's input to that module → `iso`."""
    for i, (attn_fn, ffn_fns) in enumerate(sub_fns):
        t = tmodel.layers[i].layer_type
        mixer = U.mixer_sub(tmodel.layers[i])
        if attn_fn is not None:
            h = ref_caps[f"layers.{i}.{mixer}.input"].to(dtype)
            iso[f"layers.{i}.{mixer}"] = attn_fn(h, *r_tab.inputs(t)).float()
        for f, fn in ffn_fns.items():
            iso[f"layers.{i}.{f}"] = fn(ref_caps[f"layers.{i}.{f}.input"].to(dtype)).float()


def _compare_boundaries(names: list[str], iso: dict[str, torch.Tensor], prop: dict[str, torch.Tensor],
                        ref_caps: dict[str, torch.Tensor], dtype: torch.dtype,
                        policy: TolerancePolicy) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        tol = policy.for_tensor(name)
        row: dict[str, Any] = {"name": name}
        p = compare(prop[name], ref_caps[name], dtype, tol).to_dict() if name in prop else None
        if name in iso:  # a reused unit's isolated output is its propagated one: compared once
            same = p is not None and iso[name] is prop[name]
            row["isolated"] = dict(p) if same else compare(iso[name], ref_caps[name], dtype, tol).to_dict()
        if p is not None:
            row["propagated"] = p
        rows.append(row)
    return rows


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _perplexity(ref: nn.Module, comp: _Compiled, tmodel: nn.Module, ids: list[int], cfg_v: VerifyConfig,
                policy: TolerancePolicy) -> dict[str, Any] | None:
    """Perplexity of both sides through the target's compiled `logits` unit (longrange.py)."""
    n = ppl_token_count(len(ids), cfg_v.ppl_window, cfg_v.ppl_stride, cfg_v.ppl_tokens)
    if n == 0:
        return None
    ids = ids[:n]
    window = torch.tensor([ids[: cfg_v.ppl_window]])
    fn = comp.compile(U.logits_unit(tmodel), (window,))
    return perplexity_check(lambda x: ref(x).logits, fn, ids, cfg_v.ppl_window, cfg_v.ppl_stride, policy.logits)


def _localize(failing: str, tmodel: nn.Module, ref: nn.Module, cfg: ModelConfig, ref_caps: dict[str, torch.Tensor],
              seq: torch.Tensor, r_tab32: Tables, target: Target,
              policy: TolerancePolicy) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """The failing unit replayed op by op on the reference's inputs and tables (fp32 reference side)."""
    n = cfg.num_layers
    dtype = target.dtype
    if failing == "embed":
        unit_t = U.embed_unit(tmodel)
        inputs_t = inputs_r = (seq,)
    elif failing in ("norm", "logits"):
        unit_t = U.head_unit(tmodel)
        x = ref_caps[f"layers.{n - 1}"]
        inputs_t, inputs_r = (x.to(dtype),), (x,)
    else:
        i = int(failing.split(".")[1])
        unit_t = U.layer_unit(tmodel, i)
        t = tmodel.layers[i].layer_type
        x = ref_caps["embed"] if i == 0 else ref_caps[f"layers.{i - 1}"]
        inputs_t, inputs_r = (x.to(dtype), *r_tab32.cast(dtype).inputs(t)), (x, *r_tab32.inputs(t))
    return _replay(failing, unit_t, inputs_t, inputs_r, ref, target, policy)


def _replay(failing: str, unit_t: U.Unit, inputs_t: tuple[torch.Tensor, ...], inputs_r: tuple[torch.Tensor, ...],
            ref: nn.Module, target: Target,
            policy: TolerancePolicy) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    result = replay(unit_t, reference_params(unit_t, ref), inputs_t, inputs_r, target, policy)
    records = result.ops
    first_prop = next((r for r in records if not r.propagated.ok), None)
    found = culprit(records)
    first = {"unit": failing, "module": unit_t.path or failing, "num_ops": len(records),
             "first_propagated_op": first_prop.to_dict() if first_prop else None}
    if result.weights:
        first["weights"] = [w.to_dict() for w in result.weights]
    if found is None and result.weights:
        # every op is right on the reference's weights: the target's own weights are what differ
        w = result.weights[0]
        first["note"] = (f"no op is over tolerance on the reference's weights, but the target's {w.param}"
                         f"{f' (expert {w.expert})' if w.expert is not None else ''} differs from the reference's: "
                         "the error is in the weights (conversion, loading), not an op")
        return first, [r.to_dict() for r in records], w.to_dict()
    if found is None:
        first["note"] = ("no single op is over tolerance when replayed op by op in the target's numerics: "
                         "the error comes from how the target compiled the unit (fusion, reordering), not one op")
    return first, [r.to_dict() for r in records], found.to_dict() if found else None


# ---- serving paths (paths.py) ---------------------------------------------------------------------

def _serving_paths(ref: nn.Module, tokens: list[int], ref_caps: dict[str, torch.Tensor], full_logits: torch.Tensor,
                   comp: _Compiled, tmodel: nn.Module, runner: StepRunner, ref_tables: ReferenceTables,
                   cfg: ModelConfig, cfg_v: VerifyConfig, policy: TolerancePolicy, num_layers: int, mid: str,
                   sub_inputs: bool) -> dict[str, tuple[dict[str, Any], tuple | None]]:
    """Run the decode and batch paths; per path (its record, the arguments to localize its failing step).
    A hybrid model's paths also carry each row's recurrent state, judged against HF's (`_reference_states`)."""
    out: dict[str, tuple[dict[str, Any], tuple | None]] = {}
    seq_len = len(tokens)
    pool_shape = (num_layers, cfg.num_kv_heads, cfg.head_dim)
    kv_of = partial(_kv_of, num_layers=num_layers, convert=model_class(cfg).kv_from_reference)
    main = RefSeq(tokens, ref_caps, kv_of(ref_caps), full_logits)
    refs, rows, lengths = [main], [0], [seq_len]
    num_decode = max(0, min(cfg_v.decode_steps, seq_len // 2 - 2))
    if cfg_v.batch_path and seq_len >= 12:
        # Rows of different lengths and content: the sequence, a suffix of it (its own reference
        # forward, from position 0), a prefix of it (the sequence's reference rows).
        suffix = tokens[seq_len // 3:]
        caps = _reference_forward(ref, suffix, num_layers, mid, sub_inputs)
        ids = torch.tensor([suffix])
        own = comp.compile(U.logits_unit(tmodel), (ids,))(ids)[0].float()  # the target's full forward
        refs.append(RefSeq(suffix, caps, kv_of(caps), own))
        rows, lengths = [0, 1, 0], [seq_len, len(suffix), seq_len // 2]
    hybrid = bool(cfg.state_layers)
    ref_states = _reference_states(ref, refs, num_layers) if hybrid else None
    plans = [("serve", *serve_plan(refs, rows, lengths, num_decode, cfg_v.chunk_size, cfg_v.block_size,
                                   uniform_rows=hybrid))]
    if not cfg_v.decode_steps and not cfg_v.batch_path:
        plans = []
    for name, layout, steps in plans:
        run = run_path(name, layout, steps, refs, runner, ref_tables, pool_shape, policy, ref_states)
        loc = None
        k = run.failing_step
        if k is not None and run.record["steps"][k].get("tables_ok", True):
            loc = (run, k, refs, runner, ref_tables, ref_states)
        elif k is not None:  # the step's tables are wrong: blamed on the table, no op replay
            run.record["localization"] = {"step": k, **run.steps[k].describe(), "failing_unit": "tables",
                                          "table": run.record["first_bad_table"]}
        out[name] = (run.record, loc)
    return out


def _kv_of(caps: dict[str, torch.Tensor], num_layers: int, convert: Callable[..., tuple[torch.Tensor, torch.Tensor]],
           ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The reference's K/V of its attention layers, in the layout our cache holds (the model class's
    `kv_from_reference`; MLA caches one latent row where transformers keeps two tensors)."""
    return {i: convert(caps[f"kv.{i}.k"], caps[f"kv.{i}.v"]) for i in range(num_layers) if f"kv.{i}.k" in caps}


def _reference_states(ref: nn.Module, refs: list[RefSeq], num_layers: int) -> RefStates:
    """HF's recurrent states of refs[r] after its first n tokens: from its hooked forward when n is all
    of them, else from a forward over those n (a row that is a prefix of its sequence; the state before
    a failing step). Memoized: the path's final check and the localization ask for the same ones."""
    layers = [i for i in range(num_layers) if f"state.{i}.rec" in refs[0].caps]

    @functools.cache
    def states(r: int, n: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        seq = refs[r]
        if n == len(seq.tokens):
            caps = seq.caps
        else:
            hf_cache = _hf_cache(ref)
            ref(torch.tensor([seq.tokens[:n]]), cache=hf_cache, use_cache=True)
            caps = _cached(hf_cache, num_layers)
        return {i: (caps[f"state.{i}.conv"][0], caps[f"state.{i}.rec"][0]) for i in layers}

    return states


def _localize_step(run: PathRun, k: int, refs: list[RefSeq], runner: StepRunner, ref_tables: ReferenceTables,
                   ref_states: RefStates | None, *, ref: nn.Module, target: Target, policy: TolerancePolicy,
                   replay_ops: bool = True) -> dict[str, Any]:
    """The failing step's units in isolation, then (`replay_ops`) the first failing one op by op."""
    iso = isolate_step(run, k, refs, runner, ref_tables, policy, ref_states)
    step = run.steps[k]
    summary: dict[str, Any] = {"step": k, **step.describe(), "units": iso.units, "failing_unit": iso.failing}
    first: dict[str, Any] | None = None
    ops: list[dict[str, Any]] = []
    found = None
    if iso.replay_unit is not None and iso.failing is not None and not replay_ops:
        first = {"unit": iso.failing, "path": run.name, "step": k, "phase": step.phase}
    elif iso.replay_unit is not None and iso.failing is not None:
        first, ops, found = _replay(iso.failing, iso.replay_unit, iso.inputs_t, iso.inputs_r, ref, target, policy)
        first.update(path=run.name, step=k, phase=step.phase, positions=step.describe()["positions"])
        summary["culprit"] = found
    else:
        first = {"unit": None, "path": run.name, "step": k, "phase": step.phase,
                 "note": "every unit of the failing step is within tolerance on the reference's inputs, tables "
                         "and K/V (and recurrent states): the error comes from the cache the target built in "
                         "earlier steps"}
    return {"summary": summary, "first": first, "ops": ops, "culprit": found}


def _path_reason(name: str, rec: dict[str, Any]) -> str:
    k = rec["first_failing_step"]
    if k is None and not rec["kv_cache"]["ok"]:
        kv = rec["kv_cache"]["first_bad"]
        return (f"{name} path: the K/V the target cached differs from the reference's and from its own one-shot "
                f"prefill (layer {kv['layer']}, {kv['part']})")
    if k is None:
        st = rec["state"]["first_bad"]
        return (f"{name} path: the recurrent state the target carried differs from the reference's and from its "
                f"own one-shot prefill (layer {st['layer']}, {st['part']})")
    st = rec["steps"][k]
    fb = st.get("first_bad") or {}
    where = f" at row {fb['row']}, position {fb['position']}" if fb else ""
    own = st["vs_full_forward"]
    what = "its tables differ from the reference's" if not st.get("tables_ok", True) else (
        f"max row mean KL {st['max_row_mean_kl']}, {st['num_clear_flips']} clear top-1 flip(s), rel L2 "
        f"{own['rel_l2']} against the target's own full forward{'' if own['ok'] else ' (over tolerance)'}")
    return f"{name} path: step {k} ({st['phase']}, positions {st['positions']}) fails{where}: {what}"


# ---- long-range divergence ------------------------------------------------------------------------

def _long_range(div: dict[str, Any], ids: list[int], ref: nn.Module, comp: _Compiled, runner: StepRunner,
                ref_tables: ReferenceTables, tmodel: nn.Module, cfg: ModelConfig, target: Target,
                policy: TolerancePolicy, mid: str) -> dict[str, Any]:
    """Only a long-range check failed: re-run the window where divergence starts, unit by unit, and
    name the first table or unit whose output differs from the reference's at positions >= start."""
    begin, end = div["window"]
    start = div["position"]
    dtype = target.dtype
    toks = ids[begin:end]
    seq = torch.tensor([toks])
    positions = torch.arange(len(toks))[None]
    caps = _reference_forward(ref, toks, cfg.num_layers, mid, False)
    t_tab = runner.tables(positions, positions)
    r_tab32 = ref_tables.tables(positions, positions)
    r_tab = r_tab32.cast(dtype)
    late = positions[:, start:]
    rows: list[dict[str, Any]] = []
    for row in compare_tables(Tables({t: tuple(x[:, :, start:] for x in c) for t, c in t_tab.rope.items()},
                                     {t: m[:, :, start:] for t, m in t_tab.masks.items()}),
                              Tables({t: tuple(x[:, :, start:] for x in c) for t, c in r_tab32.rope.items()},
                                     {t: m[:, :, start:] for t, m in r_tab32.masks.items()}, r_tab32.nope),
                              late, positions, dtype, policy, f"window {begin}..{end}"):
        rows.append({"name": row["name"], "mode": "table", "ok": row["ok"], "rel_l2": row.get("rel_l2")})
    # propagated (the target's own tables) and isolated (the reference's inputs and tables)
    x_p = comp.compile(U.embed_unit(tmodel), (seq,))(seq)
    x0 = caps["embed"].to(dtype)

    def late_cmp(name: str, out: torch.Tensor) -> dict[str, Any]:
        return compare(out.float()[:, start:], caps[name][:, start:], dtype, policy.for_tensor(name)).to_dict()

    rows.append({"name": "embed", "mode": "isolated", **late_cmp("embed", x_p)})
    for i in range(cfg.num_layers):
        t = tmodel.layers[i].layer_type
        fn = comp.compile(U.layer_unit(tmodel, i), (x0, *r_tab.inputs(t)))
        x_in = (caps["embed"] if i == 0 else caps[f"layers.{i - 1}"]).to(dtype)
        rows.append({"name": f"layers.{i}", "mode": "isolated", **late_cmp(f"layers.{i}", fn(x_in, *r_tab.inputs(t)))})
        x_p = fn(x_p, *t_tab.inputs(t))
        rows.append({"name": f"layers.{i}", "mode": "propagated", **late_cmp(f"layers.{i}", x_p)})
    h, logits = comp.compile(U.head_unit(tmodel), (x0,))(caps[f"layers.{cfg.num_layers - 1}"].to(dtype))
    rows.append({"name": "logits", "mode": "isolated", **late_cmp("logits", logits)})
    first = next((r for r in rows if not r["ok"] and r["mode"] in ("table", "isolated")), None)
    first = first or next((r for r in rows if not r["ok"]), None)
    return {"check": "perplexity", "window": [begin, end], "first_position": start, "token_index": div["token_index"],
            "first_unit": None if first is None else first["name"], "mode": None if first is None else first["mode"],
            "rows": rows,
            "note": None if first is not None else "no unit or table differs at those positions when re-run alone"}
