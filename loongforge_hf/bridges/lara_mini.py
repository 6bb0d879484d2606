"""LaraMiniForCausalLM (Translated's Lara-4-Mini): Qwen3.5's Gated DeltaNet layers beside ungated Qwen3 attention
layers of two kinds (``layer_types``: ``sliding_attention`` rotated in a window, ``full_attention`` without rotary
embedding), Flint's experts (softmax top k, renormalised, plus an always-on shared expert) in every layer.

Choices:
- On ``Qwen3_5MoeBridge`` (``qwen3_5.py``, ``gated_deltanet.py``): the Gated DeltaNet layers as Qwen3.5's, their
  gated norm plain ``weight * x`` (transformers' ``LaraMiniRMSNormGated`` applies it in fp32, Qwen3.5's in the
  activations' dtype: the same in fp32).
- The softmax-attention layers are Qwen3's (per-head q / k RMSNorms before the rotation, GQA, no output gate: plain
  ``QKV``), megatron's ``SelfAttention`` in the hybrid slot; the window on the sliding layers
  (``layer_types.layer_windows``) and no rotary embedding on the full ones (``smollm3.no_rope_attention``), as
  Flint's. Norms plain ``weight * x`` (``LaraMiniRMSNorm``): no zero-centred gamma.
- MoE: every layer sparse, softmax top-k renormalised (``norm_topk_prob``; ``False`` refused as Qwen3.5-MoE's has no
  such switch: megatron's ``moe_router_pre_softmax`` follows it), router logits in fp32 (``router_fp32``),
  ``mlp.shared_expert`` always on without a gate. Routed experts stacked on disk as transformers 5 writes them
  (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, ``[gate; up]`` rows, and ``down_proj`` ``[E, H, F]``).
- On disk the Gated DeltaNet's input projections are one ``linear_attn.in_proj`` (rows ``[q | k | v | z | b | a]``)
  and its gated norm ``linear_attn.out_norm``, as the hub's checkpoints and transformers' ``save_pretrained`` hold
  them (its ``conversion_mapping`` splits and renames them in memory).
- Context parallelism, the dynamic cache and generate as Qwen3.5's (the window and NoPE layers through megatron's
  attention as Flint's). LoRA on every linear, the in-projections included: transformers' tree (PEFT's names) has
  ``in_proj_qkv`` / ``z`` / ``b`` / ``a``, which ``lora_mappings_for_layer`` gives the planner as Qwen3.5's split
  ``HeadSections`` over the same megatron rows (rank by rank ``[q | k | v | z | b | a]`` blocks, as the fused one
  loads them), so each has its own adapter under PEFT's name and the merged export writes the fused ``in_proj``.
- Refused (pure checks naming the field): layer kinds other than the three, ``sliding_attention`` layers without a
  window, ``norm_topk_prob=False``, and Qwen3.5's refusals (linear heads that do not split over TP,
  ``attention_bias``, ``hidden_act``, the static cache).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.gated_mappings import HeadSections
from loongforge_hf.bridges.layer_types import layer_windows
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.qwen3_5 import A, S, Qwen3_5Bridge, check_linear_attention
from loongforge_hf.bridges.qwen3_5_moe import Qwen3_5MoeBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack

LAYER_KINDS = ("linear_attention", "sliding_attention", "full_attention")


@register_bridge("LaraMiniForCausalLM")
class LaraMiniBridge(Qwen3_5MoeBridge):
    shared_expert_gate = None
    router_fp32 = True
    supports_sliding_window = True

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        check_linear_attention(c, arch, kinds=LAYER_KINDS)
        if "sliding_attention" in c.layer_types and not c.sliding_window:
            raise C.UnsupportedConfigError(f"sliding_window={c.sliding_window} with sliding_attention layers for "
                                           f"{arch}.")
        if not c.norm_topk_prob:
            raise C.UnsupportedConfigError(f"norm_topk_prob=False is not supported for {arch} (its top k is "
                                           "renormalised here).")
        super(Qwen3_5Bridge, self).check_config()

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.pop("window_size", None)
        return {**kw, "layernorm_zero_centered_gamma": False, "attention_output_gate": False,
                **layer_windows(self.hf_config)}

    def attention_module(self) -> type:
        from loongforge_hf.bridges.gated_deltanet import hybrid_self_attention

        c = self.hf_config
        full = frozenset(i for i, kind in enumerate(c.layer_types) if kind == "full_attention")
        return hybrid_self_attention(linear=self.linear_layers, key_heads=c.linear_num_key_heads,
                                     value_heads=c.linear_num_value_heads, key_dim=c.linear_key_head_dim,
                                     value_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
                                     eps=c.rms_norm_eps, attention=no_rope_attention(full))

    # ---- tensors --------------------------------------------------------------------------------------------
    def _linear_sizes(self) -> tuple[int, int, int]:
        c = self.hf_config
        return (c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim,
                c.linear_num_value_heads)

    def attention_mappings(self) -> list[Mapping]:
        return DenseBridge.attention_mappings(self)

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return DenseBridge.attention_shapes(self, prefix)

    def linear_attention_mappings(self) -> list[Mapping]:
        kd, vd, nv = self._linear_sizes()
        fused = {m.megatron: m for m in (
            HeadSections(f"{S}.in_proj.weight", ((f"{A}.in_proj.weight", (kd, kd, vd, vd, nv, nv)),)),
            Replicated(f"{S}.norm_weight", f"{A}.out_norm.weight"))}
        return [fused.get(m.megatron, m) for m in super().linear_attention_mappings()]

    def lora_mappings_for_layer(self, layer: int) -> list[Mapping]:
        """The layer's mappings as LoRA's planner sees transformers' tree: the in-projections split (Qwen3.5's)."""
        split = {m.megatron: m for m in Qwen3_5Bridge.linear_attention_mappings(self)}
        return [split[m.megatron] if m.megatron == f"{S}.in_proj.weight" else m for m in self.mappings_for_layer(layer)]

    def linear_attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        kd, vd, nv = self._linear_sizes()
        p, h = f"{prefix}.linear_attn", self.hf_config.hidden_size
        shapes = {k: v for k, v in super().linear_attention_shapes(prefix).items()
                  if not k.startswith((f"{p}.in_proj_", f"{p}.norm."))}
        return {**shapes, f"{p}.in_proj.weight": (2 * kd + 2 * vd + 2 * nv, h),
                f"{p}.out_norm.weight": (self.hf_config.linear_value_head_dim,)}

    def moe_mappings(self) -> list[Mapping]:
        routed = f"{D}.mlp.experts."
        maps = [m for m in super().moe_mappings() if not m.megatron.startswith(routed)]
        return [*maps, routed_stack(self, StackedGateUp, "linear_fc1.weight", f"{L}.mlp.experts.gate_up_proj"),
                routed_stack(self, StackedDown, "linear_fc2.weight", f"{L}.mlp.experts.down_proj")]

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        shapes = {k: v for k, v in super().moe_shapes(prefix).items() if ".mlp.experts." not in k}
        return {**shapes, f"{prefix}.mlp.experts.gate_up_proj": (n, 2 * f, h),
                f"{prefix}.mlp.experts.down_proj": (n, h, f)}
