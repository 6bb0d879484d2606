"""xLSTM 7B (``xLSTMForCausalLM``, ``model_type="xlstm"``) refused by name (``registry.refuse_architectures``): its
mLSTM mixer is a recurrence none of our kernels computes.

Choices:
- What maps to existing pieces (``docs/index.md`` has the triage of transformers 5.24's ``models/xlstm``): the
  pre-norm blocks (RMSNorms ``norm_mlstm`` / ``norm_ffn``, ``out_norm``), the SwiGLU feed-forward
  (``proj_up_gate`` / ``proj_up`` / ``proj_down``, width rounded up to ``ffn_round_up_to_multiple_of``) as megatron's
  gated MLP, no positions, the untied LM head with ``output_logit_soft_cap`` as Gemma 2's final soft-cap; heads
  split over TP and the tokens gathered under SP as the Gated DeltaNet mixer does (``gated_deltanet.py``,
  ``recurrent_common.py``).
- What is new, listed in the refusal:
  - the mLSTM cell: per head a matrix memory ``C`` (``[qk_dim / heads, v_dim / heads]``) and a normaliser ``n``,
    written with an exponential input gate ``exp(i)`` along ``v k^T`` and decayed by ``sigmoid(f)`` (log-sigmoid),
    with the max-state stabiliser ``m``; read ``h = C q / (max(|n . q|, exp(-m)) + eps)``, ``q`` scaled by
    ``(qk_dim / heads)^-1/2``. ``eps`` enters after the stabiliser, so the outputs depend (slightly) on where ``m``
    is reset: an exact kernel follows transformers' chunk layout (``chunk_size`` chunks in parallel, the remainder
    token by token in ``mode="inference"``; zero-padded to whole chunks in ``train_with_padding``).
    ``kernels/gated_delta_rule.py`` writes a delta-rule correction and has no input gate or normaliser,
    ``kernels/lightning_attention.py`` a fixed decay, ``kernels/linear_scan.py`` a diagonal state;
  - the mLSTM layer around it: ``gate_soft_cap`` (``cap * tanh(x / cap)``) on the per-head input / forget gate
    pre-activations, separate q / k widths (``qk_dim_factor``) and v width (``v_dim_factor``), a per-head LayerNorm
    (``multihead_norm``) times a ``sigmoid`` output gate over the full v width before ``out_proj``, and
    the ``weight_mode="fused"`` layout (``qkv_opreact``, ``ifgate_preact``) beside ``"single"``;
  - its cached generate: the ``(C, n, m)`` states of ``xLSTMCache`` per block in our KV cache.
"""

from __future__ import annotations

from loongforge_hf.bridges.registry import refuse_architectures

XLSTM = ("its mLSTM mixer needs a kernel not built here: a per-head matrix memory written with an exponential input "
         "gate along v k^T, decayed by sigmoid forget gates, with a normaliser n and the max-state stabiliser m, read "
         "as C q / (max(|n . q|, exp(-m)) + eps) in transformers' chunk layout (chunk_size, mode); "
         "gated_delta_rule (a delta-rule correction), lightning attention (a fixed decay) and linear_scan (a "
         "diagonal state) compute other recurrences. Around it the mLSTM layer (gate_soft_cap on the input / forget "
         "gates, qk_dim_factor / v_dim_factor widths, a per-head multihead_norm times a sigmoid output gate, "
         "weight_mode='fused') and the (C, n, m) states of its cache are not built either")
refuse_architectures(XLSTM, "xLSTMForCausalLM")
