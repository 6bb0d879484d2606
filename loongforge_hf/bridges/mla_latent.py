"""Multi-latent attention under tensor + sequence parallelism: the KV down projection hands megatron its latent at
full width, so the rotary key's gradient sums over every rank's heads.

Why: megatron-core 0.16's ``MLASelfAttention`` with its local (column-parallel) down projections gathers the KV
latent ``[kv_lora_rank + qk_pos_emb_head_dim]`` over TP, keeps the rotary key ``k_pos_emb`` at full sequence
length and uses it in this rank's heads only; the gather's backward then keeps this rank's columns of that partial
gradient, so the other ranks' heads never reach ``kv_a_proj_with_mqa``'s rotary rows or the layer input. The
forward is exact; the gradients are not (measured on the CPU backend, DeepSeek-V2 tiny, TP2 + SP: the last layer's
``linear_kv_down_proj`` gradient 0.3% off, the earlier layers' every gradient off through the input). megatron's
other branch, taken when the latent arrives at full width on the local sequence shard (Transformer Engine's
duplicated linear), gathers ``k_pos_emb`` over the sequence, whose backward sums the ranks' contributions.

What: after ``ColumnParallelLinear.forward`` (this rank's latent columns for the whole sequence), the columns are
gathered over TP and the sequence scattered back, which megatron itself does for the query latent; the weight stays
column-split (the checkpoint layout, LoRA, dist-checkpointing unchanged). An instance-level ``forward``, not a hook:
megatron refuses to graph modules with hooks, and a LoRA re-class of the module keeps it. Tensor parallelism without
sequence parallelism never meets MLA here: the DeepSeek models always have experts, and a mixture-of-experts model
needs sequence parallelism under TP (``parallel/config.py``).
"""

from __future__ import annotations

import types


def full_width_kv_latent(chunk) -> None:
    """Every MLA layer of ``chunk`` (tensor parallel with sequence parallelism) gets the full-width KV latent."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for module in chunk.modules():
        if isinstance(module, MLASelfAttention):
            down = module.linear_kv_down_proj
            if isinstance(down, ColumnParallelLinear) and "forward" not in vars(down):
                down.forward = types.MethodType(_full_width_forward, down)


def _full_width_forward(self, hidden_states, *args, **kwargs):
    """``[s / TP, b, h]`` -> ``[s / TP, b, kv_lora_rank + qk_pos_emb_head_dim]`` (and megatron's bias output)."""
    from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                        scatter_to_sequence_parallel_region)

    out, bias = type(self).forward(self, hidden_states, *args, **kwargs)  # [s, b, columns / TP]
    full = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
    return scatter_to_sequence_parallel_region(full, group=self.tp_group), bias
