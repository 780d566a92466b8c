"""Offline Python API: `LLM(model).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from firstlight.engine.engine import EngineConfig, LLMEngine, RequestOutput
from firstlight.engine.request import SamplingParams


def load(
    name_or_path: str | Path, dtype: str = "float32", quantization: str | None = None
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) for a model name (`firstlight models list`) or a checkpoint dir; the fp32 linears
    left after quantization (all of them without one) run on our fp32 matmuls (quant/f32.py F32Linear)."""
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model
    from firstlight.quant import apply_quantization
    from firstlight.quant.f32 import use_f32_kernel

    model, tokenizer = load_model(resolve(str(name_or_path)), dtype=dtype)
    apply_quantization(model, quantization, tokenizer=tokenizer)
    use_f32_kernel(model)
    return model, tokenizer


class LLM:
    """Generate for a list of prompts with continuous batching; returns one output per prompt.

    `model` is a model name, a checkpoint dir, or a loaded `(model, tokenizer)` pair.
    """

    def __init__(
        self,
        model: str | Path | tuple[torch.nn.Module, Any],
        dtype: str = "float32",
        config: EngineConfig | None = None,
        **config_kwargs: Any,
    ) -> None:
        if isinstance(model, tuple):
            self.model, self.tokenizer = model
        else:
            self.model, self.tokenizer = load(model, dtype)
        self.engine = LLMEngine(self.model, self.tokenizer, config or EngineConfig(**config_kwargs))

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids = [self.engine.add_request(p, sp).request_id for p, sp in zip(prompts, params_list, strict=True)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
