"""Fixes every backend needs when Transformer Engine is absent (checked against megatron-core 0.16.1)."""

from __future__ import annotations

import torch

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
    _patch_reshardable_load_without_fused_adam()
    _DONE = True


def _patch_reshardable_load_without_fused_adam() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_loongforge", False):
        return

    # optimizer/distrib_optimizer.py:936-940 copies every key of the inner optimizer's per-parameter state from the
    # checkpoint. torch's AdamW (used without TE / Apex) keeps a per-parameter `step`, which the fully_reshardable
    # format stores once in the param groups instead (distrib_optimizer.py:640-643): the copy raised KeyError('step').
    # Keys the checkpoint lacks keep the value `load_state_dict` already restored.
    def set_states(self, model_param, tensors):
        current = self._get_main_param_and_optimizer_states(model_param)
        missing = {k: current[k] for k in current if k not in tensors}
        if set(missing) - {"step"}:
            raise KeyError(f"checkpoint lacks optimizer state {sorted(set(missing) - {'step'})}")
        return original(self, model_param, {**tensors, **missing})

    set_states._loongforge = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states

    # distrib_optimizer.py:813-816 gives every parameter the *same* `step` tensor; torch's AdamW then increments it
    # in place once per parameter and step, so bias correction runs ahead after a resume. Un-share it.
    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        out = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = state["step"].clone()
        return out

    DistributedOptimizer.load_state_dict = load_state_dict
