"""The model runner: executes a Batch over the paged KV cache and returns logits to sample from.

Memory: per layer one K pool and one V pool of shape [num_blocks * block_size, Hkv, D]; token t of
a request lives in slot `block_ids[t // block_size] * block_size + t % block_size`.

`PagedKVCache` implements the model's KV contract (firstlight/models/kv_cache.py) for one forward:
`update` scatters the new K/V into their slots, then gathers each row's keys through its block
table into [B, Hkv, L, D] (L = the longest context in the group; shorter rows get key position -1
there, which the model masks) and the model runs SDPA on that. This is the "gather + SDPA" path:
simple and correct on any backend; a paged-attention kernel would read the pool directly.

Grouping (to keep padding small): all decode rows (1 token each) run as one [B, 1] forward, padded
only in L; prefill chunks run grouped by equal chunk length ([B, S], no padding at all), so a
step runs at most 1 + (number of distinct chunk lengths) forwards.

Quantized KV cache (`kv_cache_dtype="int8"|"fp8"`, firstlight/quant/kv.py): the pools hold codes,
and a parallel [slots, Hkv, 1] fp32 pool per attention layer holds one scale per (token, head); a hybrid
model's recurrent state slots stay in their own dtypes. `update` quantizes the new K/V as it scatters
them, and dequantizes what it gathers; the model's attention is unchanged. A block then costs (1 + 4/D) bytes per element instead of the model dtype's 2 or 4, so the
same --kv-cache-gib holds about 3.8x (fp32 model) or 1.9x (bf16) the tokens at D = 64.
`kv_cache_dtype="bf16"|"fp16"`: the pools hold K/V rounded to that 16-bit float (no scale): the store rounds,
the gather widens to the model's dtype, and our decode attention and native step read the pools as they are
(half the bytes of an fp32 model's cache per step).

Speculative rows of hybrid models (recurrent layers): a forward with verify rows runs the delta rule
token by token and keeps the recurrent state after every token (`keep_token_states`); after rejection
sampling, `keep_accepted_states` writes the state after each row's last accepted token into its slot.

Compiled decode (`compile_decode=True`): the decode forward is `torch.compile`d (inductor, fullgraph),
and every decode batch is padded up to a shape bucket, as vLLM does for CUDA graphs: B to the next
of 1, 2, 4, ..., max_num_seqs and L to the next of 1, 2, 3, 4, 6, 8, 12, ... blocks (times block_size),
so at most len(batch buckets) x len(key buckets) graphs are ever compiled, whatever the traffic;
with symbolic shapes, dynamo shares one graph across most buckets (3 graphs in the tests).
A padding row has token 0 at position -1, writes its K/V to a scratch slot past the last block
(`scratch_slot`) and sees only masked keys; padded key slots have key position -1. The real rows
compute exactly what they would unpadded, up to float rounding of the compiled kernels.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from firstlight import kernels
from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.engine.native_decode import NativeDecode
from firstlight.engine.request import Request
from firstlight.models.states import state_shapes
from firstlight.quant.kv import KV_CAST_FORMATS, KV_FORMATS, dequantize_kv, quantize_kv

KV_CACHE_DTYPES = ("auto", *KV_CAST_FORMATS, *KV_FORMATS)


@dataclass
class KVGroupView:
    """One KV cache group's share of a forward: where its layers write and what they gather."""

    write_slots: torch.Tensor  # [N] pool slots of the valid new tokens
    gather_slots: torch.Tensor  # [B, L]
    key_positions: torch.Tensor  # [B, L], -1 = no key


class PagedKVCache:
    """One forward's view of the pools: where to write new K/V and what to gather per row, per KV cache
    group (full-attention layers; sliding-window layers, which gather only their window), and (hybrid
    models) which recurrent state slot each row reads and writes."""

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        views: dict[str, KVGroupView],
        layer_types: Sequence[str],
        write_rows: torch.Tensor,
        state_pools: dict[int, tuple[torch.Tensor, ...]] | None = None,
        state_slots: torch.Tensor | None = None,
        scale_pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
        kv_format: str | None = None,
        dtype: torch.dtype = torch.float32,
        paged_attention: bool = False,
    ) -> None:
        self.k_pools, self.v_pools = k_pools, v_pools
        self.paged_attention = paged_attention  # see attend; the runner decides (fp32 pools on CPU)
        self.state_pools = state_pools or {}  # layer -> (conv pool, recurrent pool), [slots, ...] each
        self.state_slots = state_slots  # [B] the slot of each row
        # a verify pass over speculative rows: recurrent layers also report the state after every
        # token, layer -> (conv [B, S, C, K-1], ssm [B, S, Hv, Dk, Dv]), for rolling back rejections
        self.keep_token_states = False
        self.token_states: dict[int, tuple[torch.Tensor, ...]] = {}
        self.scale_pools, self.kv_format, self.dtype = scale_pools, kv_format, dtype
        self.views = views  # layer type -> its group's slots
        # layer -> the view of its type (recurrent layers: any view; they never call update)
        first = next(iter(views.values()))
        self._layer_views = [views.get(t, first) for t in layer_types]
        self.write_rows = write_rows  # [N] their index in the flattened [B*S] new tokens
        # index_select over the flattened slots: ~8x faster than advanced indexing on CPU (torch 2.13;
        # 0.10 vs 0.75 ms for [32, 134] slots of [3, 64] fp32), same bytes
        self._flat_slots = {t: v.gather_slots.reshape(-1) for t, v in views.items()}
        self._layer_flat = [self._flat_slots.get(t, self._flat_slots[next(iter(views))]) for t in layer_types]
        # one group: the key positions as a tensor, as every cache gives them; several: per layer type
        self.key_positions = (first.key_positions if len(views) == 1
                              else {t: v.key_positions for t, v in views.items()})

    @property
    def gather_slots(self) -> torch.Tensor:
        return next(iter(self.views.values())).gather_slots

    def begin(self, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.key_positions

    def _new_rows(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, S, D] -> the valid new tokens' [N, Hkv, D]."""
        batch, num_kv_heads, seq, head_dim = k.shape
        k_new = k.transpose(1, 2).reshape(batch * seq, num_kv_heads, head_dim)
        v_new = v.transpose(1, 2).reshape(batch * seq, num_kv_heads, head_dim)
        if self.write_rows.numel() != batch * seq:
            k_new, v_new = k_new[self.write_rows], v_new[self.write_rows]
        return k_new, v_new

    def _store(self, layer: int, view: KVGroupView, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Scatter the new tokens' K/V [N, Hkv, D] into their slots of an unquantized pool."""
        k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]
        k_pool.index_copy_(0, view.write_slots, k_new.to(k_pool.dtype))
        v_pool.index_copy_(0, view.write_slots, v_new.to(v_pool.dtype))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_kv_heads, seq, head_dim = k.shape  # k: [B, Hkv, S, D]
        view = self._layer_views[layer]
        k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]  # [slots, Hkv, D]
        k_new, v_new = self._new_rows(k, v)
        flat = self._layer_flat[layer]
        if self.scale_pools is not None:
            return self._update_quantized(layer, view, flat, k_new, v_new, num_kv_heads, head_dim)
        self._store(layer, view, k_new, v_new)
        shape = (*view.gather_slots.shape, num_kv_heads, head_dim)  # [B, L, Hkv, D]
        k_all = k_pool.index_select(0, flat).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
        v_all = v_pool.index_select(0, flat).view(shape).transpose(1, 2)
        return k_all.to(self.dtype), v_all.to(self.dtype)  # a 16-bit cache widened (else no copy)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | str | None, scale: float) -> torch.Tensor | None:
        """Store k, v [B, Hkv, S, D] as `update` does and attend q [B, H, S, D] on our CPU kernels -> [B, H, S, D];
        None (nothing stored) when this cache does not (`paged_attention` off: quantized KV, not fp32 on CPU, no
        kernel): the caller then runs `update` and SDPA. mask: the model's (boolean [B, 1, S, L], CAUSAL or None).
        One new token per row reads its keys where they lie in the pools (firstlight::paged_decode_attention, no
        gather); a prefill chunk gathers them as `update` does and runs firstlight::attention on that."""
        if not self.paged_attention:
            return None
        batch, heads, seq, head_dim = q.shape
        if seq > 1 or isinstance(mask, str):
            causal = isinstance(mask, str)
            k_all, v_all = self.update(layer, k, v)
            return kernels.attention(q, k_all, v_all, None if causal else mask, causal, scale)
        view = self._layer_views[layer]
        self._store(layer, view, *self._new_rows(k, v))
        out = kernels.paged_decode_attention(
            q.reshape(batch, heads, head_dim), self.k_pools[layer], self.v_pools[layer], view.gather_slots,
            None if mask is None else mask.reshape(batch, -1), scale)
        return out.view(batch, heads, 1, head_dim)

    def _update_quantized(
        self, layer: int, view: KVGroupView, flat: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
        num_kv_heads: int, head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.scale_pools is not None and self.kv_format is not None
        shape = (*view.gather_slots.shape, num_kv_heads, head_dim)  # [B, L, Hkv, D]
        out = []
        for pool, scales, new in ((self.k_pools[layer], self.scale_pools[0][layer], k_new),
                                  (self.v_pools[layer], self.scale_pools[1][layer], v_new)):
            codes, scale = quantize_kv(new, self.kv_format)  # [N, Hkv, D], [N, Hkv, 1]
            # one-byte codes are moved as their bytes: CPU index_copy_ has no float8 kernel (torch 2.13)
            pool.index_copy_(0, view.write_slots, codes.view(pool.dtype))
            scales.index_copy_(0, view.write_slots, scale)
            gathered = pool.index_select(0, flat).view(codes.dtype)
            got = dequantize_kv(gathered, scales.index_select(0, flat), self.dtype)
            out.append(got.view(shape).transpose(1, 2))  # [B, Hkv, L, D]
        return out[0], out[1]

    def end(self) -> None:
        pass

    def get_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        # a fresh request's slot was zeroed by the runner, so every row reads its state from the pool
        assert self.state_slots is not None, "a recurrent layer ran without state slots"
        return tuple(pool.index_select(0, self.state_slots) for pool in self.state_pools[layer])

    def set_state(self, layer: int, *state: torch.Tensor) -> None:
        assert self.state_slots is not None
        for pool, new in zip(self.state_pools[layer], state, strict=True):
            pool.index_copy_(0, self.state_slots, new.to(pool.dtype))

    def set_token_states(self, layer: int, *states: torch.Tensor) -> None:
        self.token_states[layer] = states


@dataclass
class ExecuteOutput:
    """Logits of the rows to sample (one per request that reached its last known token)."""

    sample_ids: list[str] = field(default_factory=list)
    sample_logits: torch.Tensor | None = None  # [N, V]
    # speculative rows: logits at the last known token and at each proposal, [1 + k, V]
    spec_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    # with `keep_hidden`: final hidden states at those same positions, [1 + k, E] (k = 0: [1, E])
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    # with `keep_all_hidden`: final hidden states of every token each row computed, [S, E], the first at
    # position num_computed_tokens (prefill chunks too; speculative rows: [1 + k, E])
    all_hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # rid -> [num_tokens, V]
    num_forwards: int = 0


def kv_format_of(kv_cache_dtype: str) -> str | None:
    """None for an unscaled cache (the model's own dtype, "auto", or a 16-bit float), else a scaled format of
    firstlight/quant/kv.py."""
    from firstlight.errors import FirstlightError

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise FirstlightError(f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype if kv_cache_dtype in KV_FORMATS else None


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the K/V pools: the codes' of a scaled format (fp8 codes moved as uint8 bytes), the
    16-bit float's, or the model's."""
    fmt = kv_format_of(kv_cache_dtype)
    if fmt:
        return torch.int8 if fmt == "int8" else torch.uint8
    return KV_CAST_FORMATS.get(kv_cache_dtype, model_dtype)


def _consecutive_rows(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """rows as one [N, V] tensor without a copy where they are consecutive rows of one tensor (a decode step's
    logits, in batch order: torch.stack copied 6 MB a step at batch 32, ~1.7 ms), else None."""
    first = rows[0]
    if first.dim() != 1 or first.stride() != (1,):
        return None
    v, off, storage = first.shape[0], first.storage_offset(), first.untyped_storage().data_ptr()
    for i, r in enumerate(rows):
        if (r.shape != first.shape or r.stride() != (1,) or r.dtype != first.dtype
                or r.untyped_storage().data_ptr() != storage or r.storage_offset() != off + i * v):
            return None
    return first.as_strided((len(rows), v), (v, 1), off)


def _input_ids(request: Request, seq: ScheduledSeq) -> list[int]:
    """The tokens a row computes: known tokens, then (speculative decode) the proposals."""
    stop = seq.context_len - seq.num_spec_tokens
    return request.token_ids_slice(seq.num_computed_tokens, stop) + request.spec_token_ids[: seq.num_spec_tokens]


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes a compiled decode runs at: 1, 2, 4, ... below max_num_seqs, then max_num_seqs."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return (*sizes, max_num_seqs)


def key_buckets(max_keys: int, block_size: int) -> tuple[int, ...]:
    """Key lengths a compiled decode gathers: 1, 2, 3, 4, 6, 8, 12, ... blocks (2^k and 1.5 * 2^k, so
    padding wastes at most a third of the keys), capped at max_keys' blocks."""
    max_blocks = -(-max_keys // block_size)
    sizes, b = {1}, 2
    while b < max_blocks:
        sizes.update((b, b + b // 2))
        b *= 2
    return tuple(block_size * n for n in sorted(n for n in sizes if n < max_blocks)) + (block_size * max_blocks,)


def bucket_up(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class CompiledDecode:
    """`forward_hidden` under torch.compile (inductor, fullgraph, symbolic shapes), counting its graphs.

    It compiles the unbound method and takes the model as an argument: dynamo keeps its graphs on the
    code object anyway, and this way the cache below holds no reference to the model.
    """

    def __init__(self, model_cls: type) -> None:
        self._compile_ids: set[tuple[object, object]] = set()
        self._fn = torch.compile(model_cls.forward_hidden, backend=self._count_and_compile, dynamic=True, fullgraph=True)

    @property
    def num_compiles(self) -> int:
        return len(self._compile_ids)

    def _count_and_compile(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        """Inductor, counting compiles by dynamo's compile id (frame, recompile number): an analysis
        that dynamo restarts calls the backend again under the same id."""
        from torch._guards import CompileContext
        from torch._inductor.compile_fx import compile_fx

        cid = CompileContext.current_compile_id()
        self._compile_ids.add((cid.frame_id, cid.frame_compile_id) if cid else ("?", len(self._compile_ids)))
        return compile_fx(gm, example_inputs)

    def __call__(self, model: torch.nn.Module, max_graphs: int, *args: object) -> torch.Tensor:
        # every bucket pair may need its own graph: raise dynamo's recompile limit (default 8) by that
        # many, or it would silently fall back to eager past the limit
        limit = torch._dynamo.config.recompile_limit + max_graphs
        with torch._dynamo.config.patch(recompile_limit=limit):
            return self._fn(model, *args)


_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, CompiledDecode] = weakref.WeakKeyDictionary()


def compiled_decode(model: torch.nn.Module) -> CompiledDecode:
    """One CompiledDecode per model, shared by the runners (engines) built over it."""
    if model not in _COMPILED:
        _COMPILED[model] = CompiledDecode(type(model))
    return _COMPILED[model]


class ModelRunner:
    """Owns the KV pools; turns a Batch into forwards and logits."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: str | torch.device = "cpu",
        compile_decode: bool = False,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        num_state_slots: int = 0,
        kv_cache_dtype: str = "auto",
        num_sliding_blocks: int | None = None,
        paged_attention: bool = True,
        native_decode: bool = True,
    ) -> None:
        """num_sliding_blocks: the sliding-window layers get pools of their own with this many blocks,
        paged by the Batch's `sliding_block_ids` (engine/kv_groups.py); None: they share `block_ids`."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        # one slot past the last block: where a compiled decode's padding rows write their K/V
        self.scratch_slot = num_blocks * block_size
        kv_layers = set(cfg.kv_layers)
        self.kv_format = kv_format_of(kv_cache_dtype)
        pool_dtype = kv_pool_dtype(kv_cache_dtype, self.dtype)
        sliding = {i for i in kv_layers if cfg.window(i)}
        self.window = cfg.sliding_window if sliding else None
        self.num_sliding_blocks = num_sliding_blocks if sliding else None
        self.sliding_scratch_slot = (num_sliding_blocks or num_blocks) * block_size
        # the attention types with K/V, in a fixed order: each is one KV cache group's view per forward
        self._kv_types = sorted({cfg.layer_types[i] for i in kv_layers})

        def kv_pools(tail: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            def shape(i: int) -> tuple[int, ...]:
                if i not in kv_layers:
                    return (0,)  # recurrent layers keep no K/V: an empty pool keeps the list indexed by layer
                slots = self.sliding_scratch_slot if i in sliding else self.scratch_slot
                return (slots + 1, *tail)
            return [self._pool(shape(i), dtype) for i in range(cfg.num_layers)]

        # attention on our kernels (PagedKVCache.attend: decode over the pools in place), where they apply: an fp32
        # model on CPU over fp32, bf16 or fp16 pools
        self.paged_attention = (paged_attention and self.device.type == "cpu" and self.dtype == torch.float32
                                and pool_dtype in (torch.float32, *KV_CAST_FORMATS.values())
                                and kernels.load_kernel() is not None)
        # each forward's slots in one call of ours (_group_view) on CPU
        self.slots_kernel = self.device.type == "cpu" and kernels.load_kernel() is not None
        self.k_pools = kv_pools((cfg.num_kv_heads, cfg.head_dim), pool_dtype)
        self.v_pools = kv_pools((cfg.num_kv_heads, cfg.head_dim), pool_dtype)
        self.scale_pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        if self.kv_format:  # one fp32 scale per (token, head) beside the codes
            self.scale_pools = (kv_pools((cfg.num_kv_heads, 1), torch.float32),
                                kv_pools((cfg.num_kv_heads, 1), torch.float32))
        # recurrent layers: one state slot per running request (+1 scratch slot for padding rows)
        self.num_state_slots = num_state_slots
        self.state_pools = {
            layer: tuple(self._pool((num_state_slots + 1, *s), dt) for s, dt in state_shapes(model, layer))
            for layer in (cfg.state_layers if num_state_slots else ())
        }
        self.state_slot_of: Callable[[str], int] | None = None  # request id -> its slot (the cache manager's)
        self.keep_hidden = False  # a heads proposer needs the hidden states that sampled
        self.keep_all_hidden = False  # an MTP proposer needs the hidden state of every position
        # hybrid models, last verify pass: request id -> (its row's per-token states by layer, row)
        self._token_states: dict[str, tuple[dict[int, tuple[torch.Tensor, ...]], int]] = {}
        self._forward: Callable[..., torch.Tensor] = model.forward_hidden
        self.compile_decode = compile_decode
        max_keys = min(max_model_len or cfg.max_position_embeddings, num_blocks * block_size)
        self.batch_buckets = batch_buckets(max_num_seqs)
        self.key_buckets = key_buckets(max_keys, block_size)
        self._compiled = compiled_decode(model) if compile_decode else None
        # every layer of an uncompiled decode step in one native call, where it applies (engine/native_decode.py)
        self.native_decode: NativeDecode | None = None
        self.native_decode_declined = "off"
        if native_decode and self.paged_attention and not compile_decode:
            self.native_decode, self.native_decode_declined = NativeDecode.build(model, self.k_pools, self.v_pools)
        self.decode_shapes: set[tuple[int, int]] = set()  # (B, L) buckets the compiled decode ran

    @property
    def max_decode_graphs(self) -> int:
        """The most graphs the compiled decode can build: one per (batch bucket, key bucket)."""
        return len(self.batch_buckets) * len(self.key_buckets)

    @property
    def num_decode_compiles(self) -> int:
        """Graphs compiled so far for this model's decode (shared by every runner over the model)."""
        return self._compiled.num_compiles if self._compiled is not None else 0

    def _pool(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    @staticmethod
    def kv_bytes_per_block(
        model: torch.nn.Module, block_size: int, kv_cache_dtype: str = "auto", layers: Sequence[int] | None = None
    ) -> int:
        """K + V bytes of one block over `layers` (default: every layer with K/V; with a scaled cache: codes + fp32
        scales)."""
        cfg = model.config
        pool_dtype = kv_pool_dtype(kv_cache_dtype, next(model.parameters()).dtype)
        per_elem = 1.0 + 4.0 / cfg.head_dim if kv_format_of(kv_cache_dtype) else float(pool_dtype.itemsize)
        num_layers = len(cfg.kv_layers if layers is None else layers)
        return int(2 * num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * per_elem)

    @staticmethod
    def state_bytes_per_slot(model: torch.nn.Module) -> int:
        """Recurrent-state bytes of one request over all its recurrent layers (never quantized: the
        KV-cache dtype applies to K/V only)."""
        return sum(math.prod(shape) * dtype.itemsize
                   for layer in model.config.state_layers
                   for shape, dtype in state_shapes(model, layer))

    @torch.inference_mode()
    def execute(self, batch: Batch, requests: dict[str, Request]) -> ExecuteOutput:
        out = ExecuteOutput()
        self._token_states.clear()
        groups: dict[int, list[ScheduledSeq]] = defaultdict(list)
        for seq in batch.seqs:
            groups[seq.num_tokens].append(seq)
        logits_by_id: dict[str, torch.Tensor] = {}
        for num_tokens, seqs in sorted(groups.items()):
            self._run_group(seqs, num_tokens, requests, logits_by_id, out)
            out.num_forwards += 1
        out.sample_ids = [s.request_id for s in batch.seqs if s.request_id in logits_by_id and not s.num_spec_tokens]
        out.spec_logits = {s.request_id: logits_by_id[s.request_id] for s in batch.seqs if s.num_spec_tokens}
        if out.sample_ids:
            rows = [logits_by_id[rid] for rid in out.sample_ids]
            out.sample_logits = _consecutive_rows(rows)
            if out.sample_logits is None:
                out.sample_logits = torch.stack(rows)
        return out

    def _run_group(
        self,
        seqs: list[ScheduledSeq],
        num_tokens: int,
        requests: dict[str, Request],
        logits_by_id: dict[str, torch.Tensor],
        out: ExecuteOutput,
    ) -> None:
        dev = self.device
        input_ids = torch.tensor([_input_ids(requests[s.request_id], s) for s in seqs], dtype=torch.long)  # [B, S]
        starts = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.long)
        positions = starts[:, None] + torch.arange(num_tokens)  # [B, S]
        self._reset_fresh_states(seqs)
        if num_tokens == 1 and self.compile_decode:
            hidden = self._run_compiled_decode(seqs, input_ids, positions)
        elif num_tokens == 1 and self.native_decode is not None:
            hidden = self.native_decode(input_ids.to(dev), positions.to(dev), self._make_cache(seqs, positions))
        else:
            cache = self._make_cache(seqs, positions)
            # a hybrid model's verify pass keeps the recurrent state after every token (rollback)
            spec_rows = [i for i, s in enumerate(seqs) if s.num_spec_tokens]
            cache.keep_token_states = bool(self.state_pools) and bool(spec_rows)
            hidden = self._forward(input_ids.to(dev), positions.to(dev), cache)  # [B, S, E]
            for i in spec_rows if cache.keep_token_states else ():
                self._token_states[seqs[i].request_id] = (cache.token_states, i)
        if self.keep_all_hidden:
            for i, s in enumerate(seqs):
                out.all_hidden[s.request_id] = hidden[i]

        want_prompt = [
            requests[s.request_id].sampling_params.prompt_logprobs is not None and s.is_prefill for s in seqs
        ]
        for i, s in enumerate(seqs):
            if want_prompt[i]:
                out.prompt_logits[s.request_id] = self.model.compute_logits(hidden[i]).float()
        rows = [i for i, s in enumerate(seqs) if s.context_len - s.num_spec_tokens == requests[s.request_id].num_tokens]
        if not rows:
            return
        spec = [i for i in rows if seqs[i].num_spec_tokens]
        if len(spec) < len(rows):
            plain = [i for i in rows if not seqs[i].num_spec_tokens]
            # [N, E]: the last token of each row that samples (every row, as in a decode step: a view, no copy)
            last = hidden[:, -1] if len(plain) == hidden.shape[0] else hidden[plain, -1]
            logits = self.model.compute_logits(last)
            for j, i in enumerate(plain):
                logits_by_id[seqs[i].request_id] = logits[j]
                if self.keep_hidden:
                    out.hidden[seqs[i].request_id] = last[j : j + 1]
        for i in spec:  # the last known token and the k proposals: k + 1 distributions to verify
            h = hidden[i, -(seqs[i].num_spec_tokens + 1) :]  # [1 + k, E]
            logits_by_id[seqs[i].request_id] = self.model.compute_logits(h)
            if self.keep_hidden:
                out.hidden[seqs[i].request_id] = h

    @torch.inference_mode()
    def keep_accepted_states(self, num_accepted: dict[str, int]) -> None:
        """Hybrid models, after verification: a verify pass over 1 + k tokens left each row's recurrent
        state after its last proposal; put back the state after its last accepted token (the pass kept
        the state after every token), so rejected proposals leave no trace. vLLM keeps such per-token
        states in extra cache slots for the same reason."""
        for rid, accepted in num_accepted.items():
            kept = self._token_states.pop(rid, None)
            if kept is None:
                continue
            states, row = kept
            assert self.state_slot_of is not None
            slot = self.state_slot_of(rid)
            for layer, per_token in states.items():
                for pool, t in zip(self.state_pools[layer], per_token, strict=True):
                    pool[slot] = t[row, accepted].to(pool.dtype)
        self._token_states.clear()

    def _run_compiled_decode(
        self, seqs: list[ScheduledSeq], input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The decode rows, padded to a (B, L) bucket, through the compiled forward: [B, 1, E]."""
        num_rows = len(seqs)
        padded_rows = bucket_up(num_rows, self.batch_buckets)
        num_keys = bucket_up(max(s.context_len for s in seqs), self.key_buckets)
        pad = padded_rows - num_rows
        input_ids = torch.cat([input_ids, input_ids.new_zeros(pad, 1)])  # [Bp, 1]
        positions = torch.cat([positions, positions.new_full((pad, 1), -1)])  # [Bp, 1]; -1 = padding
        cache = self._make_cache(seqs, positions, num_keys)
        self.decode_shapes.add((padded_rows, num_keys))
        dev = self.device
        assert self._compiled is not None
        hidden = self._compiled(self.model, self.max_decode_graphs, input_ids.to(dev), positions.to(dev), cache)
        return hidden[:num_rows]  # [B, 1, E]

    def _reset_fresh_states(self, seqs: list[ScheduledSeq]) -> None:
        """Zero the state slots of rows that start from token 0 (new, or resumed after preemption)."""
        if not self.state_pools:
            return
        assert self.state_slot_of is not None
        fresh = [self.state_slot_of(s.request_id) for s in seqs if s.num_computed_tokens == 0]
        if fresh:
            index = torch.tensor(fresh, device=self.device)
            for pools in self.state_pools.values():
                for pool in pools:
                    pool.index_fill_(0, index, 0)

    def _make_cache(
        self, seqs: list[ScheduledSeq], positions: torch.Tensor, num_keys: int | None = None
    ) -> PagedKVCache:
        """Write and gather slots for `positions` [Bp, S] (rows past len(seqs), position -1, are padding:
        they write to the scratch slot and see no key), one view per KV cache group. Full-attention
        layers gather L = num_keys keys, or the longest context; sliding-window layers gather only the
        keys some query of the row can see (from num_computed - W + 1 on), bucketed when num_keys is."""
        context = [s.context_len for s in seqs]
        computed = [s.num_computed_tokens for s in seqs]
        pos = positions[: len(seqs)].cpu()
        pad = positions.shape[0] - len(seqs)
        views = {}
        for t in self._kv_types:
            sliding = t == "sliding_attention"
            own = sliding and self.num_sliding_blocks is not None
            tables = [s.sliding_block_ids if own else s.block_ids for s in seqs]
            scratch = self.sliding_scratch_slot if own else self.scratch_slot
            views[t] = self._group_view(tables, context, computed, pos, self.window if sliding else None,
                                        num_keys, pad, scratch)
        dev = self.device
        state_slots = None
        if self.state_pools:
            assert self.state_slot_of is not None
            slots = [self.state_slot_of(s.request_id) for s in seqs] + [self.num_state_slots] * pad
            state_slots = torch.tensor(slots, device=dev)
        num_new = positions.numel()
        return PagedKVCache(self.k_pools, self.v_pools, views, self.model.config.layer_types,
                            torch.arange(num_new, device=dev), self.state_pools, state_slots,
                            scale_pools=self.scale_pools, kv_format=self.kv_format, dtype=self.dtype,
                            paged_attention=self.paged_attention)

    def _group_view(
        self, tables: list[tuple[int, ...]], context: list[int], computed: list[int], pos: torch.Tensor,
        window: int | None, num_keys: int | None, pad: int, scratch: int,
    ) -> KVGroupView:
        bs = self.block_size
        lo = [max(c - window + 1, 0) for c in computed] if window else [0] * len(computed)  # first visible key
        num_gathered = max(c - first for c, first in zip(context, lo, strict=True))
        if num_keys is not None:  # compiled decode: the key length is a bucket
            num_gathered = num_keys if window is None else bucket_up(num_gathered, self.key_buckets)
        max_blocks = max(len(t) for t in tables)
        table = torch.tensor([list(t) + [0] * (max_blocks - len(t)) for t in tables])  # [B, blocks]
        dev = self.device
        if self.slots_kernel:  # the arithmetic below in one call (~20 small ops: ~0.2 ms of a decode step)
            write_slots, gather_slots, key_positions = kernels.paged_slots(
                table, torch.tensor(context), torch.tensor(lo), pos, num_gathered, bs, pad, scratch)
            return KVGroupView(write_slots, gather_slots, key_positions)
        ctx, first = torch.tensor(context)[:, None], torch.tensor(lo)[:, None]
        key_pos = first + torch.arange(num_gathered)  # [B, L]
        valid = key_pos < ctx
        at = torch.minimum(key_pos, ctx - 1)  # invalid keys read a real slot, then are masked
        gather_slots = torch.where(valid, table.gather(1, at // bs) * bs + at % bs, 0)
        key_positions = torch.where(valid, key_pos, -1)
        write_slots = table.gather(1, pos // bs) * bs + pos % bs  # [B, S]; every new token is valid
        if pad:
            gather_slots = torch.cat([gather_slots, gather_slots.new_zeros(pad, num_gathered)])
            key_positions = torch.cat([key_positions, key_positions.new_full((pad, num_gathered), -1)])
            write_slots = torch.cat([write_slots, write_slots.new_full((pad, pos.shape[1]), scratch)])
        return KVGroupView(write_slots.reshape(-1).to(dev), gather_slots.to(dev), key_positions.to(dev))
