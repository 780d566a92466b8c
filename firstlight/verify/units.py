"""Units (the pieces a target compiles) and module-boundary capture on either side.

Boundary names are ours; the HF reference module of each comes from `hf_module_name`:

    embed                  input of layers.0 (Gemma's sqrt(E) scale included)
    layers.i.self_attn     attention output          layers.i.mlp   MLP output
    layers.i.resid_mid     residual stream between attention and MLP (input of the MLP's norm)
    layers.i               layer output (the residual stream after the layer)
    norm                   final norm output         logits         model output

A layer's sub-layer boundaries are its token mixer, then its feed-forward modules (`layer_subs`),
named after the module on both sides (same names in ours and HF's):

    mixer   layers.i.self_attn (attention; also a Gated DeltaNet `linear_attn`, compared there)
            layers.i.mamba     (Granite 4.0-H's Mamba-2 mixer)
    FFN     layers.i.mlp       (a dense MLP or a whole MoE block: router, experts, shared expert)
            layers.i.block_sparse_moe, layers.i.shared_mlp   (Granite: routed experts and the
            ungated shared MLP side by side, each a boundary; their sum times the residual
            multiplier is the layer's update, so neither alone is an `mlp`)
    either  layers.i.mixer     (Nemotron-H: a layer is one module, a token mixer (Mamba-2,
            attention) or an FFN (MLP, MoE) by its kind; no `resid_mid`, no second module)

A unit is embed (ids → x), layers.i ((x, cos, sin, mask) → x) or head (x → (norm, logits)); its
parameters are trailing inputs (see firstlight/targets/base.py). Targets whose compiled units hide
the inside of a layer (no hooks) also compile a layer's attention ((h, cos, sin, mask) → out) and
MLP (h → out) as units of their own, so `layers.i.self_attn` and `layers.i.mlp` are still
compared in isolation (each given the reference's input to that module).

Serving-path units (keys and signatures in firstlight/targets/base.py): `step_unit` is a whole
forward through a paged KV cache (prefill, chunked prefill, batched prefill, decode: one module,
shapes decide), `step_layer_unit` one layer of it (what op replay of a failing decode step
walks), `tables_unit` the rotary tables and masks the model builds once per forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from firstlight.models.config import ATTENTION_TYPES, MLP, MOE
from firstlight.models.kv_cache import NoCache
from firstlight.targets.base import unit_phase


def mid_norm_name(layer: nn.Module) -> str:
    """The norm whose input is the residual stream between attention and MLP."""
    return "pre_feedforward_layernorm" if hasattr(layer, "pre_feedforward_layernorm") else "post_attention_layernorm"


FFN_PARTS = ("block_sparse_moe", "shared_mlp")  # a layer without `mlp`: these, side by side (Granite)
# Nemotron-H blocks whose one module (`mixer`) is an FFN, by kind: ours `layer_type`, HF's `block_type`
FFN_BLOCK_TYPES = (MLP, MOE)


def _is_ffn_block(layer: nn.Module) -> bool:
    return getattr(layer, "layer_type", getattr(layer, "block_type", None)) in FFN_BLOCK_TYPES


def mixer_sub(layer: nn.Module) -> str | None:
    """The boundary name of a layer's token mixer: `mamba` for a Mamba-2 layer, `mixer` for a Nemotron-H
    block, else `self_attn`; None for a Nemotron-H MLP or MoE block (no token mixer)."""
    if getattr(layer, "mixer", None) is not None:
        return None if _is_ffn_block(layer) else "mixer"
    return "mamba" if getattr(layer, "mamba", None) is not None else "self_attn"


def ffn_subs(layer: nn.Module) -> tuple[str, ...]:
    """A layer's feed-forward boundaries: `mlp`, the routed experts and shared MLP it has (Granite), or
    a Nemotron-H MLP or MoE block's `mixer`."""
    if getattr(layer, "mixer", None) is not None:
        return ("mixer",) if _is_ffn_block(layer) else ()
    if getattr(layer, "mlp", None) is not None:
        return ("mlp",)
    return tuple(n for n in FFN_PARTS if getattr(layer, n, None) is not None)


def layer_subs(layer: nn.Module) -> tuple[str, ...]:
    """Sub-layer boundary names of one layer in model order (mixer, then FFN); the rule reads the
    layer's modules, so it gives the same names on our layer and on the HF reference's."""
    mixer = mixer_sub(layer)
    return (*((mixer,) if mixer else ()), *ffn_subs(layer))


def has_resid_mid(layer: nn.Module) -> bool:
    """Whether a residual stream lies between two modules of the layer (`resid_mid`); a one-module
    block (Nemotron-H) has none."""
    return len(layer_subs(layer)) > 1


def boundary_names(model: nn.Module, sub_layer: bool = True, resid_mid: bool = True) -> list[str]:
    """Boundaries in model order; `resid_mid` only exists where hooks see inside a layer."""
    names = ["embed"]
    for i, layer in enumerate(model.layers):
        if sub_layer:
            first, *rest = layer_subs(layer)
            names += [f"layers.{i}.{first}", *([f"layers.{i}.resid_mid"] if resid_mid and rest else []),
                      *(f"layers.{i}.{f}" for f in rest)]
        names.append(f"layers.{i}")
    return names + ["norm", "logits"]


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def _store(store: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> None:
    store[name] = t.detach().float().clone()


@contextmanager
def capture(
    root: nn.Module,
    store: dict[str, torch.Tensor],
    resolve: Callable[[str], str] = lambda n: n,
    layers: int = 0,
    sub_layer: bool = True,
    mid_norm: str = "post_attention_layernorm",
    inputs_too: bool = False,
    sub_inputs: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Record boundary tensors (fp32 copies) into `store` while the context is open.

    `resolve` maps our module path to the module path in `root` (identity for our model,
    `hf_module_name` for the HF reference). `inputs_too` also records each layer's input as
    `layers.i.input` (needed when units run out of order); `sub_inputs` the inputs of the sub-layer
    modules (`layer_subs`) as `layers.i.self_attn.input`, `layers.i.mlp.input`, ... (the sub-layer
    units' inputs).
    """
    handles = []

    def out_hook(name: str) -> Callable[..., None]:
        return lambda m, args, out: _store(store, name, _first(out))

    def in_hook(name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple, kwargs: dict) -> None:
            _store(store, name, args[0] if args else kwargs["hidden_states"])

        return hook

    try:
        for i in range(layers):
            layer = root.get_submodule(resolve(f"layers.{i}"))
            handles.append(layer.register_forward_hook(out_hook(f"layers.{i}")))
            if i == 0:
                handles.append(layer.register_forward_pre_hook(in_hook("embed"), with_kwargs=True))
            elif inputs_too:
                handles.append(layer.register_forward_pre_hook(in_hook(f"layers.{i}.input"), with_kwargs=True))
            if sub_layer:
                for sub in layer_subs(layer):
                    mod = _sub_module(root, resolve, i, sub)
                    handles.append(mod.register_forward_hook(out_hook(f"layers.{i}.{sub}")))
                    if sub_inputs:
                        handles.append(mod.register_forward_pre_hook(in_hook(f"layers.{i}.{sub}.input"), with_kwargs=True))
                if has_resid_mid(layer):
                    mod = root.get_submodule(resolve(f"layers.{i}.{mid_norm}"))
                    handles.append(mod.register_forward_pre_hook(in_hook(f"layers.{i}.resid_mid"), with_kwargs=True))
        handles.append(root.get_submodule(resolve("norm")).register_forward_hook(out_hook("norm")))
        yield store
    finally:
        for h in handles:
            h.remove()


def _sub_module(root: nn.Module, resolve: Callable[[str], str], i: int, sub: str) -> nn.Module:
    """`layers.i.<sub>`; in hybrid models a linear-attention layer's mixer (`linear_attn`) stands in for
    `self_attn`, so its output is compared at the same boundary (`layers.i.self_attn`)."""
    try:
        return root.get_submodule(resolve(f"layers.{i}.{sub}"))
    except AttributeError:
        if sub != "self_attn":
            raise
        return root.get_submodule(resolve(f"layers.{i}.linear_attn"))


# ---- adapters: tensor-only forwards over the model's own modules ---------------------------------

class LogitsAdapter(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


class EmbedAdapter(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The model's own `embed` (Gemma's sqrt(E) scale included), so the op-level trace's
        # stack points at the model file's line, not at torch's nn.Embedding.
        return self.model.embed(ids)


class LayerAdapter(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = self.layer.layer_type
        return self.layer(x, {t: (cos, sin)}, {t: mask}, NoCache())


def mixer_module(layer: nn.Module) -> nn.Module:
    """The layer's token mixer: attention, Gated DeltaNet (`linear_attn`), Mamba-2 (`mamba`) or a
    Nemotron-H block's (`mixer`)."""
    for name in ("self_attn", "linear_attn", "mamba", "mixer"):
        mod = getattr(layer, name, None)
        if mod is not None:
            return mod
    raise AttributeError(f"{type(layer).__name__} has no token mixer (self_attn, linear_attn, mamba)")


class AttentionAdapter(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """h: the mixer's input (after the layer's input norm) [B, S, E] → mixer output [B, S, E].
        A recurrent mixer (linear attention, Mamba-2) starts from a zero state and ignores the tables."""
        mixer = mixer_module(self.layer)
        if self.layer.layer_type in ATTENTION_TYPES:  # attention (or MLA): takes tables, a mask, a cache
            return mixer(h, cos, sin, mask, NoCache())
        return mixer(h, NoCache())


class MLPAdapter(nn.Module):
    def __init__(self, layer: nn.Module, name: str = "mlp") -> None:
        super().__init__()
        self.layer, self.name = layer, name

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: the FFN module's input (after its norm) [B, S, E] → its output [B, S, E] (before any
        residual multiplier)."""
        return getattr(self.layer, self.name)(h)


class HeadAdapter(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.model.norm(x)
        return h, self.model.compute_logits(h)


class SlotStates:
    """The recurrent-state half of the cache protocol (models/kv_cache.py) over per-row state slots,
    without mutating them, as the engine's runner keeps them (runner.py `get_state` / `set_state`).

    pools: (conv [num_state_layers, num_state_slots, C, K-1], recurrent [num_state_layers,
    num_state_slots, ...]), one entry per recurrent layer in `layers` order; state_slots [B]: the slot
    of each row (a scratch slot for a padding row, so it writes nothing any real row reads). A fresh
    row's slot holds zeros, as the engine zeroes a request's slot before its first token. `single`:
    the pools hold one layer, whatever index the mixer passes. `pools()` are the updated pools.
    """

    def __init__(self, pools: tuple[torch.Tensor, ...], state_slots: torch.Tensor, layers: tuple[int, ...] = (),
                 single: bool = False) -> None:
        self.state_pools, self.state_slots, self.layers, self.single = pools, state_slots, layers, single
        self.written: dict[int, tuple[torch.Tensor, ...]] = {}

    def _index(self, layer: int) -> int:
        return 0 if self.single else self.layers.index(layer)

    def get_state(self, layer: int) -> tuple[torch.Tensor, ...]:
        i = self._index(layer)
        return tuple(pool[i].index_select(0, self.state_slots) for pool in self.state_pools)

    def set_state(self, layer: int, *state: torch.Tensor) -> None:
        i = self._index(layer)
        self.written[i] = tuple(pool[i].index_copy(0, self.state_slots, new.to(pool.dtype))
                                for pool, new in zip(self.state_pools, state, strict=True))

    def pools(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.stack([self.written[i][part] if i in self.written else pool[i]
                                  for i in range(pool.shape[0])])
                     for part, pool in enumerate(self.state_pools))


class PagedKV:
    """The model's KV-cache protocol (models/kv_cache.py) over a slot pool, without mutating it.

    pool: [num_layers, 2, num_slots, Hkv, D]; write_slots [B*S] (the pool slot of each new token,
    a scratch slot for padding); gather_slots [B, L] (each row's keys through its block table);
    key_positions [B, L] (-1: no key there). `update` scatters with `index_copy` (out of place)
    and gathers with `index_select`, as the engine's paged cache does in place; `pool()` is the
    updated pool. `single`: the pool holds one layer, whatever index the attention passes.
    `states` (hybrid models): the recurrent layers' state slots, read and written through it.
    """

    def __init__(self, pool: torch.Tensor, write_slots: torch.Tensor, gather_slots: torch.Tensor,
                 key_positions: torch.Tensor | None = None, single: bool = False,
                 states: SlotStates | None = None) -> None:
        self.kv, self.write_slots, self.gather_slots = pool, write_slots, gather_slots
        self.key_positions, self.single, self.states = key_positions, single, states
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        assert self.key_positions is not None, "a one-layer PagedKV gets its mask from the caller"
        return self.key_positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = 0 if self.single else layer
        batch, num_kv_heads, seq, head_dim = k.shape  # k, v: [B, Hkv, S, D]
        k_new = k.transpose(1, 2).reshape(batch * seq, num_kv_heads, head_dim).to(self.kv.dtype)
        v_new = v.transpose(1, 2).reshape(batch * seq, num_kv_heads, head_dim).to(self.kv.dtype)
        k_pool = self.kv[i, 0].index_copy(0, self.write_slots, k_new)  # [num_slots, Hkv, D]
        v_pool = self.kv[i, 1].index_copy(0, self.write_slots, v_new)
        self.written[i] = (k_pool, v_pool)
        flat = self.gather_slots.reshape(-1)
        shape = (*self.gather_slots.shape, num_kv_heads, head_dim)  # [B, L, Hkv, D]
        k_all = k_pool.index_select(0, flat).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
        v_all = v_pool.index_select(0, flat).view(shape).transpose(1, 2)
        return k_all, v_all

    def end(self) -> None:
        pass

    def get_state(self, layer: int) -> tuple[torch.Tensor, ...]:
        assert self.states is not None, "a recurrent layer ran without state slots"
        return self.states.get_state(layer)

    def set_state(self, layer: int, *state: torch.Tensor) -> None:
        assert self.states is not None, "a recurrent layer ran without state slots"
        self.states.set_state(layer, *state)

    def pool(self) -> torch.Tensor:
        layers = [torch.stack(self.written[i]) if i in self.written else self.kv[i] for i in range(self.kv.shape[0])]
        return torch.stack(layers)


class StepAdapter(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.state_layers = tuple(model.config.state_layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                gather_slots: torch.Tensor, key_positions: torch.Tensor, kv: torch.Tensor,
                *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ids, positions: [B, S] → (logits [B, S, V], the pool with this step's K/V written). A hybrid
        model also takes state_slots [B] and its state pools (`SlotStates`) and returns them updated."""
        states = SlotStates(tuple(state[1:]), state[0], self.state_layers) if self.state_layers else None
        cache = PagedKV(kv, write_slots, gather_slots, key_positions, states=states)
        logits = self.model(ids, positions, cache)
        return logits, cache.pool(), *(states.pools() if states is not None else ())


class StepLayerAdapter(nn.Module):
    def __init__(self, layer: nn.Module, recurrent: bool) -> None:
        super().__init__()
        self.layer, self.recurrent = layer, recurrent

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                *cached: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [B, S, E] and what the layer caches → (layer output, that cache updated): write_slots,
        gather_slots and its pool kv [2, num_slots, Hkv, D]; or, for a recurrent layer, state_slots [B]
        and its state pools [num_state_slots, ...] (one tensor per state, `SlotStates`)."""
        t = self.layer.layer_type
        if self.recurrent:
            states = SlotStates(tuple(c[None] for c in cached[1:]), cached[0], single=True)
            out = self.layer(x, {t: (cos, sin)}, {t: mask}, states)
            return out, *(p[0] for p in states.pools())
        write_slots, gather_slots, kv = cached
        cache = PagedKV(kv[None], write_slots, gather_slots, single=True)
        out = self.layer(x, {t: (cos, sin)}, {t: mask}, cache)
        return out, cache.pool()[0]


class TablesAdapter(nn.Module):
    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, positions: torch.Tensor, key_positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per layer type (sorted): cos, sin [B, 1, S, D] and the boolean mask [B, 1, S, L]."""
        rope = self.model.rope_tables(positions, self.dtype)
        masks = self.model.masks(positions, key_positions, allow_shortcuts=False)
        return tuple(x for t in sorted(rope) for x in (*rope[t], masks[t]))


class Unit(nn.Module):
    """An adapter with the parameters it uses as trailing forward inputs (torch.func.functional_call)."""

    def __init__(self, adapter: nn.Module, uses: list[nn.Module], path: str, key: str, attr: str) -> None:
        super().__init__()
        self.adapter = adapter
        self.path, self.key, self.attr = path, key, attr  # attr: adapter attribute that maps to `path`
        self.phase = unit_phase(key)  # "prefill" | "decode": what op replay passes in OpSite.phase
        wanted = {id(p) for m in uses for p in m.parameters()}
        self.param_names = [n for n, p in adapter.named_parameters() if id(p) in wanted]

    def params(self) -> list[torch.Tensor]:
        named = dict(self.adapter.named_parameters())
        return [named[n] for n in self.param_names]

    def forward(self, *args: torch.Tensor) -> Any:
        num_inputs = len(args) - len(self.param_names)
        params = dict(zip(self.param_names, args[num_inputs:], strict=True))
        return torch.func.functional_call(self.adapter, params, tuple(args[:num_inputs]))

    def model_path(self, adapter_path: str) -> str:
        """Our module path for a module path relative to the adapter ('layer.mlp' → 'layers.3.mlp')."""
        if adapter_path == self.attr or adapter_path.startswith(self.attr + "."):
            rest = adapter_path[len(self.attr):].lstrip(".")
            return ".".join(p for p in (self.path, rest) if p)
        return self.path


def logits_unit(model: nn.Module) -> Unit:
    return Unit(LogitsAdapter(model), [model], "", "logits", "model")


def embed_unit(model: nn.Module) -> Unit:
    return Unit(EmbedAdapter(model), [model.embed_tokens], "", "embed", "model")


def layer_unit(model: nn.Module, i: int) -> Unit:
    layer = model.layers[i]
    return Unit(LayerAdapter(layer), [layer], f"layers.{i}", f"layer:{layer.layer_type}", "layer")


def attention_unit(model: nn.Module, i: int) -> Unit:
    """The layer's token mixer (attention, linear attention or Mamba-2): key `attn:<layer type>`."""
    layer = model.layers[i]
    return Unit(AttentionAdapter(layer), [mixer_module(layer)], f"layers.{i}", f"attn:{layer.layer_type}", "layer")


def mlp_unit(model: nn.Module, i: int, name: str = "mlp") -> Unit:
    """One feed-forward module of the layer (`ffn_subs`): key `mlp`, or its name (`block_sparse_moe`,
    `shared_mlp`); a Nemotron-H block's `mixer:<layer type>` (an MLP and an MoE share no artifact)."""
    layer = model.layers[i]
    key = f"{name}:{layer.layer_type}" if name == "mixer" else name
    return Unit(MLPAdapter(layer, name), [getattr(layer, name)], f"layers.{i}", key, "layer")


def head_unit(model: nn.Module) -> Unit:
    return Unit(HeadAdapter(model), [model.norm, model.lm_head], "", "head", "model")


def step_unit(model: nn.Module, phase: str = "prefill") -> Unit:
    """A whole forward through a paged KV cache; key `prefill` or `decode` (its phase)."""
    return Unit(StepAdapter(model), [model], "", phase, "model")


def step_layer_unit(model: nn.Module, i: int, phase: str = "decode") -> Unit:
    """One layer of a step: through its K/V pool, or its state slots for a recurrent layer."""
    layer = model.layers[i]
    key = f"decode_layer:{layer.layer_type}" if phase == "decode" else f"prefill_layer:{layer.layer_type}"
    adapter = StepLayerAdapter(layer, recurrent=i in model.config.state_layers)
    return Unit(adapter, [layer], f"layers.{i}", key, "layer")


def tables_unit(model: nn.Module, dtype: torch.dtype) -> Unit:
    return Unit(TablesAdapter(model, dtype), [], "", "tables", "model")
