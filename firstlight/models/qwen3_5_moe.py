"""Qwen3.5-MoE (`qwen3_5_moe`, e.g. Qwen3.5-35B-A3B): Qwen3-Next's hybrid decoder with four changes,
so it runs on qwen3_next.py's modules, configured by models/config.py.

    x = embed(ids)
    for each layer (3 Gated DeltaNet : 1 gated full attention, `layer_types`):
        x = x + mixer(norm(x));  x = x + moe(norm(x))       # as Qwen3-Next, see qwen3_next.py
    logits = lm_head(norm(x))                               # + the native MTP layer(s), as Qwen3-Next

What differs from Qwen3-Next (transformers' modular_qwen3_5_moe.py over modular_qwen3_next.py):

1. Gated DeltaNet in-projections: four flat linears `in_proj_qkv` [q | k | v], `in_proj_z`, `in_proj_b`,
   `in_proj_a` (each all heads in order) instead of `in_proj_qkvz` / `in_proj_ba` grouped per key head.
   Ours stacks them into one `linear_attn.in_proj` (`LinearAttnConfig.grouped_in_proj = False`); the
   recurrence, conv, gated norm and decay are unchanged.
2. Every layer is sparse MoE (no `decoder_sparse_step`, `mlp_only_layers`, `intermediate_size`), and the
   router always renormalizes its top-k (no `norm_topk_prob`). A sigmoid-gated shared expert, as before.
3. Interleaved multimodal rope (`mrope_section`, `mrope_interleaved`): the rotary dims are split among
   temporal / height / width positions. For text every token has t = h = w = its index, so it is the
   1-D partial rope (`partial_rotary_factor`, default 0.25) that Qwen3-Next uses.
4. The MTP layer count is `mtp_num_hidden_layers` (Qwen3-Next: `num_nextn_predict_layers`).

The hub checkpoints are vision-language models (`Qwen3_5MoeForConditionalGeneration`): config.json is a
wrapper with `text_config` and `vision_config`, and the files hold the text model under
`model.language_model.`, the vision tower under `model.visual.`, the LM head and `mtp.*` at the top.
firstlight is a text LLM toolkit, so loading one gives its text model (what
`AutoModelForCausalLM.from_pretrained` gives too): the vision tower's tensors are not read, and prompts
are text only; image and video inputs are not supported. A text-only checkpoint (`qwen3_5_moe_text`,
`model.layers.*`, as `Qwen3_5MoeForCausalLM` saves it) loads the same way. Every other tensor is checked
as for any family: a missing or unexpected one is a load error.
"""

from __future__ import annotations

from firstlight.models.qwen3_next import Qwen3Next


class Qwen3_5Moe(Qwen3Next):  # noqa: N801 (transformers' spelling of the family)
    """The Qwen3.5-MoE text model: Qwen3Next built from a `qwen3_5_moe` ModelConfig."""
