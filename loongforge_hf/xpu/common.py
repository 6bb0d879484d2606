"""Fixes every backend needs when Transformer Engine is absent (checked against megatron-core 0.16.1)."""

from __future__ import annotations

_DONE = False


def apply_without_te_fixes() -> None:
    global _DONE
    if _DONE:
        return
    from megatron.core.transformer.moe import moe_utils

    # transformer/moe/moe_utils.py:34 imports `te_general_gemm` only when TE imports, yet line 1192
    # (RouterGatingLinearFunction.forward) reads the name unconditionally: without TE it is a NameError.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    # transformer/multi_latent_attention.py:54-62 sets HAVE_TE = True whenever extensions/transformer_engine imports,
    # which it also does without TE (its TE classes are then MagicMocks); line 185 then calls
    # `isinstance(self.linear_proj, TELinear)` with a mock and MLASelfAttention cannot be built.
    if not te_ext.HAVE_TE:
        mla.HAVE_TE = False
    _DONE = True
