"""LoRA's names for DeepSeek-V4 and HY-V4: from transformers' module tree, which PEFT matches and names adapters by,
to the checkpoint's tensor names the bridges read (the planner's ``checkpoint_name``).

Choices:
- The table is transformers' own: every checkpoint name of the bridge (``expected_hf_shapes``) renamed by the
  ``WeightRenaming`` entries of transformers' conversion mapping for the model type (what ``from_pretrained`` does
  to it), so ``self_attn.q_a_proj`` is read as ``attn.wq_a``, ``self_attn.compressor.indexer.scorer.weights_proj`` as
  ``attn.indexer.weights_proj``, HY-V4's ``self_attn.gate_proj`` as ``self_attn.linear_gate``.
- Refused by name, whatever else the config asks: the routed experts' stacks (``mlp.experts.gate_up_proj`` /
  ``down_proj``, PEFT's ``target_parameters``; here megatron's ``SequentialMLP`` with its clamped SwiGLU, which has no
  adapter path) and the router (``mlp.gate.weight``: the hash / ``sqrtsoftplus`` routers of DeepSeek-V4 and HY-V4's
  router are not compared with PEFT's adapter on it). PEFT's config rewrite does not apply to these model types, so
  ``gate_proj`` / ``up_proj`` / ``down_proj`` name the shared experts (and HY-V4's dense MLPs) only, as in PEFT.
"""

from __future__ import annotations

import re

_PARAMS = re.compile(r"\.layers\.\d+\.mlp\.(?:experts\.(?:gate_up_proj|down_proj)|gate\.weight)$")


def module_tree_names(bridge) -> dict[str, str]:
    """{transformers' module-tree name: the checkpoint's} for every tensor the bridge reads (computed once)."""
    table = bridge.__dict__.get("_lora_names")
    if table is None:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        renamings = [r for r in get_checkpoint_conversion_mapping(bridge.hf_config.model_type) or []
                     if type(r) is WeightRenaming]
        table = {apply_renamings(name, renamings): name for name in bridge.expected_hf_shapes()}
        bridge.__dict__["_lora_names"] = table
    return table


def checkpoint_name(bridge, name: str) -> str:
    """The checkpoint's name of transformers' tensor ``name`` (itself where the table has none); the routed experts'
    stacks and the router refused by name (module docstring)."""
    from loongforge_hf.lora.plan import LoraConfigError

    if _PARAMS.search(name):
        arch = bridge.architectures[0]
        raise LoraConfigError(f"LoRA on {name} is not supported for {arch}: the routed experts (mlp.experts."
                              "gate_up_proj / down_proj) run as megatron's SequentialMLP with the clamped SwiGLU and "
                              "the routers by their own rule, with no adapter path compared with PEFT there; adapt "
                              "the attention's linears and the shared experts (target_modules, e.g. 'all-linear' "
                              "with the exclusions the planner names) and leave target_parameters empty.")
    return module_tree_names(bridge).get(name, name)
