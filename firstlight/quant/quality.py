"""Quality gate of a quantized model: perplexity on a text, its ratio to the unquantized model's,
and the mean KL(unquantized || quantized) of the next-token distributions (in nats)."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch

# Goals of issue 7 on SmolLM2-135M (perplexity ratio vs fp32 on the hamlet sample).
PPL_RATIO_GOALS = {"int8": 1.005, "fp8": 1.01, "int4": 1.05, "w8a8": 1.01}  # w8a8: issue 15


@dataclass
class QualityResult:
    format: str
    perplexity: float
    ppl_ratio: float  # perplexity / unquantized perplexity
    mean_kl: float  # nats per token, KL(unquantized || quantized)
    num_tokens: int
    weight_bytes: int
    kernel: str
    goal: float | None = None
    method: str = "rtn"
    calibration: str = ""

    @property
    def passed(self) -> bool | None:
        return None if self.goal is None else self.ppl_ratio <= self.goal

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def corpus_ids(tokenizer: Any, corpus: str, max_tokens: int) -> list[int]:
    """The first max_tokens token ids of a corpus (a name from firstlight.data or a text file)."""
    from firstlight.data import load_text
    from firstlight.errors import FirstlightError

    text = load_text(corpus)
    # Tokenize a prefix only: ~4 characters per token is generous for English and code.
    ids = tokenizer.encode(text[: max_tokens * 8])[:max_tokens]
    if len(ids) < 2:
        raise FirstlightError(f"corpus '{corpus}' gives {len(ids)} token(s); perplexity needs at least 2")
    return ids


@torch.inference_mode()
def evaluate_formats(
    model: torch.nn.Module,
    ids: list[int],
    formats: list[str],
    *,
    window: int = 512,
    stride: int = 256,
    with_kl: bool = True,
    quant_opts: dict[str, dict[str, Any]] | None = None,
) -> tuple[QualityResult, list[QualityResult]]:
    """(unquantized result, one result per format); `model` itself is left unquantized."""
    from firstlight.eval.ppl import mean_kl, perplexity
    from firstlight.quant.model import model_weight_bytes, quantize_model

    ref_ppl = perplexity(model, ids, window=window, stride=stride)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    base = QualityResult("none", ref_ppl.perplexity, 1.0, 0.0, ref_ppl.num_tokens, model_weight_bytes(model),
                         f"{dtype} dense matmul")
    results = []
    for fmt in formats:
        qmodel = copy.deepcopy(model)
        report = quantize_model(qmodel, fmt, **(quant_opts or {}).get(fmt, {}))
        ppl = perplexity(qmodel, ids, window=window, stride=stride)
        kl = mean_kl(model, qmodel, ids, window=window) if with_kl else float("nan")
        results.append(QualityResult(fmt, ppl.perplexity, ppl.perplexity / ref_ppl.perplexity, kl, ppl.num_tokens,
                                     report.weight_bytes_after, report.kernel, PPL_RATIO_GOALS.get(fmt),
                                     report.method, report.calibration))
        del qmodel
    return base, results
