"""MiniMaxM2ForCausalLM (MiniMax-M2, MiniMax-M2.1): grouped-query attention with q / k norms over all heads and partial
rotary, and a sigmoid-routed mixture of experts with a fixed expert bias in every layer.

Choices:
- Attention is the dense bridges' (``linear_qkv`` fused per KV group, no biases, ``head_dim`` independent of hidden /
  heads). Its q / k norms span the whole projection (``q_norm`` ``[heads * head_dim]``, ``k_norm`` ``[kv heads *
  head_dim]``), as OLMoE's: ``olmo2.full_width_norm`` in megatron's q / k norm slots, split over TP like the heads
  (each rank's sum of squares added up over the group), megatron's ``qk_layernorm`` off; Llama's rounding
  (``round_first``: the normalised input to the input dtype, then the weight multiply), as transformers' norm.
- Partial rotary: the config's ``rotary_dim`` (64 of 128 in the hub's models), which transformers turns into
  ``rope_parameters.partial_rotary_factor``, is megatron's ``rotary_percent``: both rotate the first channels of each
  head in rotate-half pairs and pass the rest through. Rope: plain or llama3; YaRN is refused (its attention factor
  would need the q / k norm slots these norms take).
- Every layer sparse: ``num_local_experts`` experts of ``intermediate_size``, no shared expert. Routing is DeepSeek-V3's
  without groups or scaling: sigmoid scores, the top ``num_experts_per_tok`` of the scores plus the block's
  ``e_score_correction_bias`` (megatron's fp32 ``router.expert_bias``, fixed: ``moe_router_bias_update_rate=0``, as
  transformers never updates it), the chosen sigmoid scores renormalised (always, in transformers; megatron for k > 1
  only, so ``num_experts_per_tok=1`` is refused). The router weight and the bias are written in the model's dtype, as
  transformers keeps them (not in fp32, as DeepSeek-V3's); the bias routes at the file's precision (transformers: the
  model's), and megatron rounds the sigmoid scores to the logits' dtype: exact in fp32, near ties apart in bf16.
- transformers' ``router_logits`` and balancing loss (``output_router_logits``, ``router_aux_loss_coef``): Mixtral's
  formula on the softmax of the logits, its slot counts the top k without the bias (``router_balance.py``).
  ``router_jitter_noise`` other than 0 is refused, as for Mixtral.
- On disk the sparse block is ``block_sparse_moe`` (the hub's files, and what transformers' ``save_pretrained`` writes
  from its stacked experts): ``gate.weight``, ``e_score_correction_bias`` beside it (not inside ``gate``), and one
  tensor per expert and projection, ``experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), read and written so.
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.mixtral import MixtralBridge
from loongforge_hf.bridges.olmo2 import FullWidthQKNorms
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("MiniMaxM2ForCausalLM")
class MiniMaxM2Bridge(FullWidthQKNorms, MixtralBridge):
    """Mixtral's expert naming and counts (``block_sparse_moe``, ``w1`` / ``w3`` / ``w2``, ``num_local_experts``,
    every layer sparse, transformers' router logits and balancing loss) with MiniMax-M2's routing and attention."""

    supports_sliding_window = False  # NOTE: transformers' MiniMax-M2 attends to every position (unlike Mixtral)
    extra_rope_types = ()
    expert_bias = True
    expert_bias_name = "e_score_correction_bias"

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if c.num_local_experts < 1:
            raise C.UnsupportedConfigError(f"num_local_experts={c.num_local_experts}: MiniMax-M2 needs experts.")
        if c.num_experts_per_tok < 2:
            raise C.UnsupportedConfigError(
                f"num_experts_per_tok={c.num_experts_per_tok} is not supported (at least 2): transformers renormalises "
                "a single sigmoid score to 1, megatron keeps it.")
        if getattr(c, "router_jitter_noise", 0.0):
            # NOTE: transformers jitters the whole MoE input in training only; megatron's moe_input_jitter_eps jitters
            # the router input alone, in eval too
            raise C.UnsupportedConfigError(f"router_jitter_noise={c.router_jitter_noise} is not supported (only 0).")
        super().check_config()

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_bias_update_rate": 0.0}

    # ---- tensors --------------------------------------------------------------------------------------------
    def moe_mappings(self) -> list[Mapping]:
        # NOTE: transformers keeps this bias in the model's dtype (a plain buffer), not in fp32 as DeepSeek-V3's
        return [Replicated(m.megatron, m.hf) if m.megatron.endswith(".router.expert_bias") else m
                for m in super().moe_mappings()]
