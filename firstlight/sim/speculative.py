"""Speculative decoding with a native multi-token-prediction (MTP) head, as a cost-model wrapper.

Each decode step of a sequence drafts `k` tokens with the MTP layer (k sequential one-layer forwards:
the MTP decoder layer, its `eh_proj` and the shared LM head) and verifies them in one target forward
over k+1 tokens. With an i.i.d. per-token acceptance `a` the step yields

    E = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)        (E = k+1 when a = 1)

tokens on average (Leviathan et al. 2023, eq. 1; DeepSeek-V3 report sec. 5.4.3 for MTP). The serving
loop advances every decode by one token per step, so a decode step is priced at 1/E of the speculative
step (verify + drafting): the mean TPOT and throughput are right, the burstiness of E tokens landing
at once is spread evenly. In a step that also runs prefill chunks only the decodes' marginal share is
scaled (the weights are read once for both):

    t = T(prefill) + (T(prefill + verify) + T_draft - T(prefill)) / E

where T(verify) prices each decode as a (k+1)-token chunk after its cached context (the KV is read once
for the k+1 queries, the weights once for the batch). The MTP layer's weights are not in the memory
plan (one decoder layer, small beside the model).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from firstlight.errors import FirstlightError
from firstlight.sim.model import Linear, ModelDesc


class SpeculativeError(FirstlightError):
    """An MTP / speculative-decoding option out of range."""


def expected_tokens_per_step(acceptance: float, num_draft: int) -> float:
    """Tokens one verify step yields with i.i.d. acceptance `acceptance` of each of `num_draft` drafts."""
    if not 0 <= acceptance <= 1:
        raise SpeculativeError(f"--mtp-acceptance {acceptance}: expected a probability in [0, 1]")
    if num_draft < 1:
        raise SpeculativeError(f"--mtp-tokens {num_draft}: expected >= 1 drafted token per step")
    if acceptance == 1:
        return float(num_draft + 1)
    return (1 - acceptance ** (num_draft + 1)) / (1 - acceptance)


def mtp_model(model: ModelDesc) -> ModelDesc:
    """The MTP module as a one-layer model: a decoder layer shaped like the model's attention layers,
    plus eh_proj (2h -> h, joining the embedding and the last hidden state) and its two norms; it shares
    the embedding and the LM head (DeepSeek-V3 sec. 2.2, Qwen3-Next)."""
    g = model.attention_group
    h = model.hidden_size
    layer = replace(g, num_layers=1, attn_linears=g.attn_linears + (Linear("mtp_eh_proj", 2 * h, h),),
                    num_norm_params=g.num_norm_params + 2 * h)
    return replace(model, name=f"{model.name}-mtp", groups=(layer,))


class SpecCost:
    """A CostModel whose decode steps run MTP speculation: `draft` is a CostModel of `mtp_model(model)`."""

    def __init__(self, cost: Any, acceptance: float, num_draft: int, draft: Any | None = None) -> None:
        if cost.par.pp > 1:
            raise SpeculativeError("--mtp-acceptance with --pp > 1 is not modeled yet; use pp=1")
        self.cost = cost
        self.acceptance = acceptance
        self.num_draft = num_draft
        self.tokens_per_step = expected_tokens_per_step(acceptance, num_draft)
        self.draft = draft

    def __getattr__(self, name: str) -> Any:  # par, step_s, model, hw ... come from the wrapped model
        return getattr(self.cost, name)

    def draft_time(self, num_decode: int, decode_ctx_sum: float) -> float:
        """k drafting forwards of the MTP layer over the decodes (no extra step or sequence overhead)."""
        if self.draft is None or not num_decode:
            return 0.0
        d = self.draft
        one = d.step_time(num_decode, num_decode, num_decode, decode_ctx_sum) - d.step_s - d.seq_s * num_decode
        return self.num_draft * one

    def verify_chunks(self, num_decode: int, decode_ctx_sum: float) -> list[tuple[int, int]]:
        """Each decode as a (k+1)-token chunk after its cached context (the mean context)."""
        cached = max(decode_ctx_sum / num_decode - 1, 0.0)
        return [(self.num_draft + 1, cached)] * num_decode

    def step_time(self, num_tokens: int, num_seqs: int, num_decode: int = 0, decode_ctx_sum: float = 0.0,
                  prefill_chunks: list[tuple[int, int]] | tuple = (), decode_window_ctx_sum: float | None = None,
                  ) -> float:
        if num_tokens <= 0:
            return 0.0
        if not num_decode:
            return self.cost.step_time(num_tokens, num_seqs, 0, 0.0, prefill_chunks)
        k = self.num_draft
        verify = self.verify_chunks(num_decode, decode_ctx_sum)
        draft = self.draft_time(num_decode, decode_ctx_sum)
        full = self.cost.step_time(num_tokens + k * num_decode, num_seqs, 0, 0.0, verify + list(prefill_chunks)) + draft
        if not prefill_chunks:
            return full / self.tokens_per_step
        # the decodes' marginal share of the mixed step (weights are read once for both) is scaled
        pre = self.cost.step_time(num_tokens - num_decode, num_seqs - num_decode, 0, 0.0, prefill_chunks)
        return pre + (full - pre) / self.tokens_per_step

    def pipelined_step_time(self, num_tokens: int, num_seqs: int, num_decode: int = 0, decode_ctx_sum: float = 0.0,
                            prefill_chunks: list[tuple[int, int]] | tuple = (), num_microbatches: int = 1,
                            schedule: str = "gpipe") -> tuple[float, float]:
        t = self.step_time(num_tokens, num_seqs, num_decode, decode_ctx_sum, prefill_chunks)
        return t, max(t - self.cost.step_s, 0.0) if num_tokens > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {"method": "mtp", "acceptance": self.acceptance, "draft_tokens": self.num_draft,
                "verify_tokens_per_seq": self.num_draft + 1, "expected_tokens_per_step": self.tokens_per_step,
                "draft_layer": self.draft is not None}
