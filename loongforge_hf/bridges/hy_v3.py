"""HYV3ForCausalLM (Tencent's Hy3-preview): K-EXAONE's mixture of experts (``exaone_moe.py``) under Apertus's
attention, every layer global.

Choices:
- Attention: grouped-query with per-head q / k norms before the rotation (megatron's ``qk_layernorm``, Qwen3's),
  no biases, Llama's rotary embedding (plain or llama3 scaling) on every layer: no windows, no NoPE layers.
- ``mlp_layer_types`` says which layers are dense (a gated MLP of ``intermediate_size``) and which sparse:
  ``num_experts`` experts of ``moe_intermediate_size`` beside ``num_shared_experts`` always-on ones as one MLP
  (``mlp.shared_mlp`` on disk, as ``save_pretrained`` writes it), as K-EXAONE's.
- Routing is DeepSeek-V3's without groups (``deepseek.sigmoid_routing_kwargs``): sigmoid scores plus a fixed bias
  (``mlp.expert_bias`` on disk), top-k renormalised (one expert a token is refused: megatron keeps a lone score as
  it is, transformers makes it 1), times ``router_scaling_factor``; the router (``mlp.router.gate``)
  and the bias in fp32 as transformers keeps them; transformers' ``router_logits``, no balancing loss.
- ``enable_moe_fp32_combine`` (transformers adds the shared experts' output to the routed one in fp32 and rounds
  once): the same in fp32; in bf16 megatron adds in bf16 (one more rounding of the sum).
- LoRA: ``checkpoint_name`` takes PEFT's names (transformers' tree: ``mlp.shared_experts``, ``mlp.gate``) to the
  checkpoint's, so ``"all-linear"`` adapts the shared experts too.
- Multi-token-prediction layers in a checkpoint (``model.layers.{num_hidden_layers + i}.*``, which transformers
  ignores) are not built: skipped on load and copied unchanged on export (``deepseek.DeepseekStyleMoE``'s).
"""

from types import SimpleNamespace

from loongforge_hf.bridges.deepseek import DeepseekStyleMoE, sigmoid_routing_kwargs
from loongforge_hf.bridges.exaone_moe import ExaoneMoeBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("HYV3ForCausalLM")
class HYV3Bridge(ExaoneMoeBridge):
    shared_experts = "shared_mlp"
    expert_bias_name = "expert_bias"
    router_name = "router.gate"
    passthrough_names = DeepseekStyleMoE.passthrough_names

    def routing_kwargs(self) -> dict:
        c = self.hf_config
        return sigmoid_routing_kwargs(SimpleNamespace(
            n_routed_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok, n_group=None, topk_group=None,
            norm_topk_prob=True, routed_scaling_factor=c.router_scaling_factor))

    def attention_module(self) -> type | None:
        return None

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of transformers' module tree (LoRA's planner), which renames the
        shared experts (``mlp.shared_mlp`` on disk) and the router (``mlp.router.gate``) on load."""
        from loongforge_hf.bridges.load_kwargs import module_tree_names

        return module_tree_names(self).get(name, name)
