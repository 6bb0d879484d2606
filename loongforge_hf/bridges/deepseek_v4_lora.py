"""LoRA's names for DeepSeek-V4 and HY-V4: from transformers' module tree, which PEFT matches and names adapters by,
to the checkpoint's tensor names the bridges read (the planner's ``checkpoint_name``).

Choices:
- The table is transformers' own: every checkpoint name of the bridge (``expected_hf_shapes``) renamed by the
  ``WeightRenaming`` entries of transformers' conversion mapping for the model type (what ``from_pretrained`` does
  to it), so ``self_attn.q_a_proj`` is read as ``attn.wq_a``, ``self_attn.compressor.indexer.scorer.weights_proj`` as
  ``attn.indexer.weights_proj``, HY-V4's ``self_attn.gate_proj`` as ``self_attn.linear_gate``.
- Parameter targets (PEFT's ``target_parameters``), named as in transformers' module tree, which ``param_targets``
  reads (their tensors are found through the bridge's mappings): the routed experts' stacks
  (``mlp.experts.gate_up_proj`` / ``down_proj``; the checkpoint holds one tensor per expert, which the stacked
  mapping reads) take the grouped MLP's expert adapters (``lora/experts.py``) as Qwen3-MoE's (refused under
  ``LOONGFORGE_MOE_GROUPED_GEMM=0``, megatron's ``SequentialMLP``), the router's weight (``mlp.gate.weight``) the
  re-classed router's ``W + s * B A`` in its gating, whose logits each rule then reads: DeepSeek-V4's
  ``sqrtsoftplus`` top-k and hash layers (the hash picks the experts, the logits weigh them), HY-V4's sigmoid. PEFT's
  config rewrite does not apply to these model types, so ``gate_proj`` / ``up_proj`` / ``down_proj`` name the shared
  experts (and HY-V4's dense MLPs) only, as in PEFT.
"""

from __future__ import annotations

import re

from loongforge_hf.bridges.load_kwargs import module_tree_names

_PARAMS = re.compile(r"\.layers\.\d+\.mlp\.(?:experts\.(?:gate_up_proj|down_proj)|gate\.weight)$")


def checkpoint_name(bridge, name: str) -> str:
    """The checkpoint's name of transformers' tensor ``name``; a parameter target's (the routed experts' stacks, the
    router) and a name the table does not hold stay transformers' (module docstring)."""
    return name if _PARAMS.search(name) else module_tree_names(bridge).get(name, name)
