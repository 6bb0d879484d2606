"""JetMoeForCausalLM (jetmoe/jetmoe-8b): every layer a mixture of attention heads (``jetmoe_attention.py``) and a
mixture of experts, both routed by softmax over each one's top-k logits.

Choices:
- Attention: ``num_key_value_heads`` KV heads of ``kv_channels`` from one ``kv_proj`` (``[k; v]`` rows), queried by
  the k chosen attention experts' query projections, their outputs through the same experts' output projections,
  gated and summed, plus ``self_attention.experts.bias``. megatron sees ``k * num_key_value_heads`` query heads in
  ``num_key_value_heads`` groups; default rope (or the shared rope types), scale ``kv_channels ** -0.5``.
- MoE: megatron's ``MoELayer`` (``moe_router_pre_softmax=False``: softmax over the k chosen logits, transformers'
  ``JetMoeTopKGating``), the experts stacked on disk (``mlp.input_linear`` ``[E, 2I, H]`` with ``[gate; up]`` rows,
  ``mlp.output_linear`` ``[E, H, I]``, silu), the router ``mlp.router.layer``, and ``mlp.bias`` after the experts
  (``jetmoe_attention.biased_moe_layer``).
- Norms: transformers builds the layers' input / post-attention norms with its default epsilon (1e-6) whatever
  ``rms_norm_eps`` says, which only the final norm reads: megatron's ``layernorm_epsilon`` is 1e-6 and the final
  norm gets ``rms_norm_eps`` (``finish_model``).
- Tensor parallelism splits the KV heads (the attention experts' heads with them) and the MoE experts as megatron's;
  expert parallelism splits the MoE experts (the attention experts stay whole on every rank: they are dense in
  tokens); pipeline and context parallelism as megatron's (the mixtures are per token). Refused by the pure checks
  (before any collective): KV heads that do not split over TP, activations other than silu.
- ``output_router_logits`` (the config's or the forward's keyword): transformers' ``router_logits`` count the
  attention experts' router beside the MoE one, per layer the attention's first (``routers_per_layer``: ``2 *
  num_hidden_layers`` of ``[batch * seq, experts]``), and its balancing loss (Mixtral's formula over all of them,
  ``aux_loss_coef`` its coefficient: ``config_map.router_aux_loss_coef_field``) tallies both
  (``router_balance``; the attention's router in ``jetmoe_attention.MoAQueryKV``).
- LoRA as PEFT adapts transformers' model: ``kv_proj`` (megatron's column-parallel ``linear_qkv.kv``, B's rows in its
  per-rank ``[k; v]`` order, as the weight's) and both routers ``router.layer``: the attention's a parameter of our
  mixture of heads (``lora/own_weights.py``, whole on every rank), the MoE's megatron's router (``lora/experts.py``:
  its gating weight ``W + s * B A``, so ``lora_dropout`` refused there). Not the expert stacks (PEFT's
  ``target_parameters``; no adapter path on them is compared with PEFT).
"""

from dataclasses import dataclass

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated
from loongforge_hf.bridges.mixtral import MixtralBridge
from loongforge_hf.bridges.packed_mappings import PackedGatedMLP
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack

LAYER_NORM_EPS = 1e-6  # NOTE: transformers' JetMoeRMSNorm default, which the decoder layers' norms keep
JETMOE_FIELDS = tuple(f for f in C.DENSE_FIELDS if f.hf != "hidden_act")  # NOTE: activation_function, checked


@dataclass(frozen=True)
class ExpertRows(ColumnParallel):
    """Every attention expert's query rows ``[E, heads * head_dim, H]``, split by heads over TP."""

    split_dim = 1


@dataclass(frozen=True)
class ExpertColumns(ColumnParallel):
    """Every attention expert's output columns ``[E, H, heads * head_dim]``, split by heads over TP."""

    tp_split = "row"
    split_dim = 2


@register_bridge("JetMoeForCausalLM")
class JetMoeBridge(MixtralBridge):
    routers_per_layer = 2  # NOTE: router_logits.RouterLogits: the attention's router, then the MoE layer's

    @property
    def lora_own_weights(self) -> dict[str, str]:
        """The attention's router, which LoRA adapts (``lora/own_weights.py``)."""
        from loongforge_hf.bridges.jetmoe_attention import MoAQueryKV

        return MoAQueryKV.lora_own_weights
    supports_sliding_window = False
    own_activation = True  # NOTE: JetMoE names it activation_function (checked here)
    config_fields = JETMOE_FIELDS

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if c.activation_function != "silu":
            raise C.UnsupportedConfigError(f"activation_function={c.activation_function!r} is not supported for "
                                           f"{arch} (only 'silu').")
        super().check_config()

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a layout the attention experts cannot run (pure: before any collective)."""
        kv, arch = self.hf_config.num_key_value_heads, self.architectures[0]
        if kv % layout.tensor_parallel_size:
            raise C.UnsupportedConfigError(f"num_key_value_heads={kv} does not split over tensor_parallel_size="
                                           f"{layout.tensor_parallel_size} for {arch} (the attention experts split "
                                           "by KV heads).")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "layernorm_epsilon": LAYER_NORM_EPS,
                "activation_func": C._act_to_megatron("silu")}

    def attention_module(self) -> type:
        from loongforge_hf.bridges.jetmoe_attention import moa_attention

        return moa_attention(experts=self.num_experts(), top_k=self.top_k())

    def moe_module(self) -> type:
        from loongforge_hf.bridges.jetmoe_attention import biased_moe_layer

        return biased_moe_layer()

    def finish_model(self, model) -> None:
        final = getattr(getattr(model, "decoder", None), "final_layernorm", None)
        if final is not None:
            final.eps = float(self.hf_config.rms_norm_eps)

    # ---- tensors --------------------------------------------------------------------------------------------
    def _heads_rows(self) -> int:
        return self.hf_config.num_key_value_heads * self.hf_config.kv_channels

    def attention_mappings(self) -> list[Mapping]:
        a, e = f"{D}.self_attention", f"{L}.self_attention.experts"
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
                Replicated(f"{a}.linear_qkv.router", f"{e}.router.layer.weight"),
                ExpertRows(f"{a}.linear_qkv.query", f"{e}.input_linear.weight"),
                PackedGatedMLP(f"{a}.linear_qkv.kv.weight", f"{L}.self_attention.kv_proj.weight", self._heads_rows()),
                ExpertColumns(f"{a}.linear_proj.weight", f"{e}.output_linear.weight"),
                Replicated(f"{a}.linear_proj.bias", f"{e}.bias")]

    def moe_mappings(self) -> list[Mapping]:
        s = f"{L}.mlp"
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                Replicated(f"{D}.mlp.router.weight", f"{s}.router.layer.weight"),
                routed_stack(self, StackedGateUp, "linear_fc1.weight", f"{s}.input_linear.weight"),
                routed_stack(self, StackedDown, "linear_fc2.weight", f"{s}.output_linear.weight"),
                Replicated(f"{D}.mlp.bias", f"{s}.bias")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, n, q = self.hf_config.hidden_size, self.num_experts(), self._heads_rows()
        e = f"{prefix}.self_attention.experts"
        return {f"{prefix}.input_layernorm.weight": (h,), f"{e}.router.layer.weight": (n, h),
                f"{e}.input_linear.weight": (n, q, h), f"{e}.output_linear.weight": (n, h, q), f"{e}.bias": (h,),
                f"{prefix}.self_attention.kv_proj.weight": (2 * q, h)}

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        s = f"{prefix}.mlp"
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{s}.router.layer.weight": (n, h),
                f"{s}.input_linear.weight": (n, 2 * f, h), f"{s}.output_linear.weight": (n, h, f), f"{s}.bias": (h,)}
