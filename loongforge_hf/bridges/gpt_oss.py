"""GptOssForCausalLM (OpenAI's gpt-oss-20b / -120b): grouped-query attention with biases and a learned sink logit per
head, sliding-window layers every other layer (``layer_types``), YaRN, and every MLP a mixture of experts whose
weights are stacked on disk.

Choices:
- Biases on every linear but the LM head (q / k / v / o, router, experts): megatron's ``add_bias_linear``.
- The sinks (``self_attn.sinks`` ``[heads]``) are megatron's learnable softmax offset (``softmax_type="learnable"``,
  ``core_attention.softmax_offset``), split over TP with the heads; our core attention appends it as a score column
  (``kernels.attention``).
- The experts' activation is megatron's quick-GELU GLU with a clamp and an offset (``activation_func_clamp_value`` =
  ``swiglu_limit``, ``glu_linear_offset`` = 1): ``gate * sigmoid(1.702 gate) * (up + 1)``, the gate clamped above
  and up on both sides; megatron's ``quick_gelu`` fixes alpha at 1.702, so another ``swiglu_alpha`` is refused.
- On disk each layer's experts are one tensor per projection: ``experts.gate_up_proj`` ``[E, H, 2I]`` with gate and
  up in alternating columns, ``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj`` ``[E, I, H]``, ``down_proj_bias``
  ``[E, H]``: read one expert at a time and written back block by block (``stacked_experts.py``).
- MXFP4 checkpoints (the hub's gpt-oss: ``*_blocks`` / ``*_scales``) are dequantised while they load
  (``fp8_checkpoint.dequantizing_reader``); export writes plain tensors.
- The router: top-k of the biased logits, softmax over the k chosen (megatron's ``moe_router_pre_softmax=False``);
  transformers' balancing loss and ``router_logits`` as for Mixtral (``moe.py``).
- The norms: transformers keeps them in fp32 (``_keep_in_fp32_modules``); here they take the model's dtype like
  every other norm (a bf16 model exports bf16 norms, which transformers loads into its fp32 ones exactly).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.layer_types import check_layer_kinds, layer_windows
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated
from loongforge_hf.bridges.mixtral import MixtralBridge
from loongforge_hf.bridges.moe import GROUPED_GEMM_ENV, grouped_experts_enabled
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, StackedRow, routed_stack
from loongforge_hf.kernels.clamped_glu import QUICK_GELU_ALPHA


@register_bridge("GptOssForCausalLM")
class GptOssBridge(MixtralBridge):
    """Mixtral's expert counts and routing (``num_local_experts``, ``intermediate_size``, every layer sparse, softmax
    over the top k); its own tensors (module docstring)."""

    qkv_bias = True
    per_layer_types = True
    hf_balance_loss = True
    hf_router_logits = True
    splits_experts = False  # NOTE: megatron-core's MoE takes expert biases at expert_tensor_parallel_size 1 only

    def check_config(self) -> None:
        super().check_config()
        c = self.hf_config
        check_layer_kinds(c, self.architectures[0])
        alpha = getattr(c, "swiglu_alpha", QUICK_GELU_ALPHA)
        if abs(alpha - QUICK_GELU_ALPHA) > 1e-9:
            raise C.UnsupportedConfigError(f"swiglu_alpha={alpha} is not supported (megatron's quick_gelu: "
                                           f"{QUICK_GELU_ALPHA}).")
        if not grouped_experts_enabled():  # NOTE: check_config runs before MoEBridge sets grouped_experts
            # NOTE: megatron's SequentialMLP adds the fc2 bias in place onto RowParallelLinear's output, a view
            # autograd refuses at one expert-tensor rank (megatron-core 0.16)
            raise C.UnsupportedConfigError(f"{GROUPED_GEMM_ENV}=0 (megatron's SequentialMLP experts) is not supported "
                                           "for GptOssForCausalLM (expert biases); unset it for the grouped experts.")
        if not getattr(c, "attention_bias", True):
            raise C.UnsupportedConfigError("attention_bias=False is not supported for GptOssForCausalLM.")

    def transformer_config_kwargs(self) -> dict:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kw = super().transformer_config_kwargs()
        kw.update(layer_windows(self.hf_config))
        kw.update(add_bias_linear=True, add_qkv_bias=True, softmax_type="learnable", activation_func=quick_gelu,
                  glu_linear_offset=1.0, activation_func_clamp_value=float(self.hf_config.swiglu_limit))
        return kw

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return super().attention_mappings() + [
            Replicated(f"{D}.self_attention.linear_proj.bias", f"{L}.self_attn.o_proj.bias"),
            ColumnParallel(f"{D}.self_attention.core_attention.softmax_offset", f"{L}.self_attn.sinks"),
        ]

    def moe_mappings(self) -> list[Mapping]:
        s = f"{L}.mlp"
        # NOTE: each expert's matrices [in, out], gate / up alternating (the grouped MLP only: check_config)
        routed = [routed_stack(self, StackedGateUp, "linear_fc1.weight", f"{s}.experts.gate_up_proj", transposed=True,
                               alternating=True),
                  routed_stack(self, StackedGateUp, "linear_fc1.bias", f"{s}.experts.gate_up_proj_bias",
                               alternating=True),
                  routed_stack(self, StackedDown, "linear_fc2.weight", f"{s}.experts.down_proj", transposed=True),
                  routed_stack(self, StackedRow, "linear_fc2.bias", f"{s}.experts.down_proj_bias")]
        return [
            Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
            Replicated(f"{D}.mlp.router.weight", f"{s}.router.weight"),
            Replicated(f"{D}.mlp.router.bias", f"{s}.router.bias"),
            *routed,
        ]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        return {**super().attention_shapes(prefix), f"{prefix}.self_attn.o_proj.bias": (c.hidden_size,),
                f"{prefix}.self_attn.sinks": (c.num_attention_heads,)}

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        s = f"{prefix}.mlp"
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{s}.router.weight": (n, h),
                f"{s}.router.bias": (n,), f"{s}.experts.gate_up_proj": (n, h, 2 * f),
                f"{s}.experts.gate_up_proj_bias": (n, 2 * f), f"{s}.experts.down_proj": (n, f, h),
                f"{s}.experts.down_proj_bias": (n, h)}
