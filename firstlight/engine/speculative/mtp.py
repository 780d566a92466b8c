"""Native multi-token prediction (MTP): the checkpoint's own MTP layer proposes k tokens (Qwen3-Next,
DeepSeek-V3 sec. 2.2; vLLM's `--speculative-config '{"method": "mtp"}'`).

The MTP layer at position p reads the target's final (normed) hidden state h_p and the embedding of
the token after it, and predicts the token after that (models/layers.py `MTPCausalLM.forward_mtp`; the
layers themselves: qwen3_next.py `MTP`, deepseek_v3.py `DeepseekV3MTP`):

    x_p = layer(fc([norm_e(embed(t_{p+1})), norm_h(h_p)]))      # its own full-attention KV at p
    logits(t_{p+2}) = lm_head(norm(x_p))

For a request with tokens t_0 .. t_{N-1} (t_{N-1} sampled, not yet in the target's KV), the target has
computed h_0 .. h_{N-2}. Per call, per request:

    catch-up: the MTP layer runs over every position whose h_p it has not seen (the prompt on the first
              call, then the last known token + the accepted proposals), with t_{p+1}: this fills its
              KV and its output at p = N-2 predicts d_1 = t_N
    draft:    for i = 2 .. k, at position N-3+i: h is the MTP's own previous output (no target state
              exists for the proposals), the token is d_{i-1}: predicts d_i

as vLLM does when num_speculative_tokens exceeds the checkpoint's MTP layers (the one layer is reused k
times). The draft steps' KV entries are guesses: the next call truncates the request's KV to the first
position with a new target hidden state, and recomputes from there with the target's real ones.
Checkpoints with several MTP layers (DeepSeek-V3 ships one, Qwen3-Next one) run only the first.

All asking requests run together, one slot each in a DraftKVPool (draft_cache.py) holding only the
MTP layer's K/V: one catch-up pass per catch-up length, then one pass per draft step. The target's
own recurrent state (Gated DeltaNet layers) is not this module's business: the runner keeps the
verify pass's per-token states and puts back the one after the last accepted token.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from firstlight.engine.speculative.adaptive import decode_bytes, module_bytes
from firstlight.engine.speculative.base import Proposal, Proposer, SpecRequest, draw_rows
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.draft_cache import DraftKVPool
from firstlight.engine.speculative.registry import register
from firstlight.errors import FirstlightError
from firstlight.models.config import MTP_FIELDS


def check_has_mtp(target: Any) -> None:
    """Raise a FirstlightError a user can act on when the target carries no MTP layer."""
    cfg = target.config
    if getattr(target, "mtp", None) is None:
        if cfg.model_type in MTP_FIELDS:
            files = f"model.layers.{cfg.num_layers}.*" if cfg.model_type == "deepseek_v3" else "mtp.*"
            why = f"its config has {cfg.mtp_field} = {cfg.hf.get(cfg.mtp_field) or 0} and no {files} weights were loaded"
        else:
            why = f"model type {cfg.model_type} has no multi-token-prediction layer (num_nextn_predict_layers / mtp.* weights)"
        raise FirstlightError(
            f"--speculative mtp needs a checkpoint with an MTP layer, but {why}; use a checkpoint that ships its "
            "MTP weights (e.g. Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3) or another method (--speculative ngram)"
        )


@register
class MTPProposer(Proposer):
    name = "mtp"
    needs_all_hidden = True

    def __init__(self, target: Any) -> None:
        check_has_mtp(target)
        self.target = target
        cfg = target.config
        p = next(target.parameters())
        self.device = p.device
        self.pool = DraftKVPool(1, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device, first_layer=cfg.num_layers)
        # one draft token reads the MTP layer and the LM head (memory-bound estimate, target 1-token passes)
        self.token_cost = module_bytes(*target.mtp.step_modules(0), target.lm_head) / decode_bytes(target)

    @classmethod
    def from_config(cls, cfg: SpecConfig, target: Any, tokenizer: Any) -> MTPProposer:
        return cls(target)

    def cost(self, k: int) -> float:
        return k * self.token_cost

    def free(self, request_id: str) -> None:
        self.pool.free(request_id)

    def _forward(self, slots: list[int], hidden: torch.Tensor, feeds: list[list[int]]) -> torch.Tensor:
        """MTP over feeds[b] after slot b's cached positions, hidden [B, S, E] → its output [B, S, E]."""
        kv = self.pool.pass_over(slots, feeds)
        ids = torch.tensor(feeds, device=self.device)
        return self.target.forward_mtp(hidden, ids, kv.positions, kv)

    @torch.inference_mode()
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        if not requests:
            return []
        slots = [self.pool.acquire(r.request_id) for r in requests]
        last: dict[int, torch.Tensor] = {}  # row -> the MTP output at its newest position [E]
        catch_up: dict[int, list[int]] = defaultdict(list)  # catch-up length -> rows
        for i, r in enumerate(requests):
            num_new = 0 if r.hidden_states is None else len(r.hidden_states)
            if r.hidden_start + num_new != len(r.token_ids) - 1:
                raise ValueError(f"{r.request_id}: hidden states for positions {r.hidden_start} .. "
                                 f"{r.hidden_start + num_new - 1}, but the last known one is {len(r.token_ids) - 2}")
            if self.pool.length(slots[i]) < r.hidden_start:
                raise ValueError(f"{r.request_id}: the MTP cache holds {self.pool.length(slots[i])} positions but "
                                 f"new hidden states start at {r.hidden_start} (a prefix-cache hit? MTP needs every one)")
            self.pool.truncate(slots[i], r.hidden_start)  # drop the previous call's draft positions
            if num_new:
                catch_up[num_new].append(i)
        for _, rows in sorted(catch_up.items()):  # catch-up, rows grouped by length n
            hidden = torch.stack([requests[i].hidden_states for i in rows])  # type: ignore[misc]  # [B, n, E]
            feeds = [requests[i].token_ids[requests[i].hidden_start + 1 :] for i in rows]
            out = self._forward([slots[i] for i in rows], hidden, feeds)
            for b, i in enumerate(rows):
                last[i] = out[b, -1]
        # a request with no new hidden state (cannot happen in the engine: it proposes only after a pass)
        # gets no proposals
        tokens: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor | None]] = [[] for _ in requests]
        for step in range(max(r.num_spec_tokens for r in requests)):
            rows = [i for i in sorted(last, key=slots.__getitem__) if requests[i].num_spec_tokens > step]
            if not rows:
                break
            if step:  # the MTP's own output stands in for the target's hidden state at the new position
                hidden = torch.stack([last[i] for i in rows])[:, None]  # [B, 1, E]
                out = self._forward([slots[i] for i in rows], hidden, [[tokens[i][-1]] for i in rows])
                for b, i in enumerate(rows):
                    last[i] = out[b, -1]
            logits = self.target.compute_logits(torch.stack([last[i] for i in rows]))  # [B, V]
            for i, (tok, q) in zip(rows, draw_rows(logits, [requests[i] for i in rows]), strict=True):
                tokens[i].append(tok)
                qs[i].append(q)
        return [
            Proposal(toks, None if r.temperature <= 0 or not toks else torch.stack(q))  # type: ignore[arg-type]
            for r, toks, q in zip(requests, tokens, qs, strict=True)
        ]
