"""Bailing hybrid (``BailingHybridForCausalLM``, inclusionAI's Ling 3) refused by name
(``registry.refuse_architectures``): Kimi Delta Attention and gated multi-latent attention layers with DeepSeek-V3
experts, whose pieces exist here but not the gates its layers need (LaraMini, triaged with it: ``lara_mini.py``).

Choices:
- Triage of transformers 5.24's ``models/bailing_hybrid``. What maps: Kimi-Linear's delta attention and DeepSeek-V3 MoE
  (``kimi_linear.py``, ``kimi_delta_attention.py``), DeepSeek's MLA with interleaved rope (``deepseek.py``). What is
  missing, listed in the refusal:
  - the bounded KDA forget gate (``kda_safe_gate``: ``kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``)
    from a full-rank ``forget_gate.f_proj``; ours is Kimi's ``-exp(A_log) * softplus(...)`` from low-rank
    ``f_a_proj`` / ``f_b_proj``;
  - the full-rank output gate ``g_proj`` of the delta layers (ours is Kimi's low-rank ``g_a_proj`` / ``g_b_proj``);
  - the per-head sigmoid output gate (``self_attn.g_proj``, ``[heads, hidden]``) of the MLA layers: megatron's
    ``MLASelfAttention`` has no ``attention_output_gate`` (only ``SelfAttention`` does).
"""

from __future__ import annotations

from loongforge_hf.bridges.registry import refuse_architectures

BAILING_HYBRID = ("it needs three pieces not built here: the bounded KDA forget gate (kda_safe_gate: "
                  "kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))) from a full-rank forget_gate.f_proj, "
                  "the full-rank output gate g_proj of the delta layers (Kimi-Linear's are low-rank g_a_proj / "
                  "g_b_proj), and the per-head sigmoid output gate self_attn.g_proj of the MLA layers (megatron's "
                  "MLASelfAttention has no attention_output_gate)")
refuse_architectures(BAILING_HYBRID, "BailingHybridForCausalLM")
