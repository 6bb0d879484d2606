"""LongcatFlashForCausalLM (Meituan's LongCat-Flash): two attention and two MLP sublayers per layer, with a mixture of
experts fed from the first MLP's input and added after the second; zero-computation (identity) experts among the
routed ones; MLA whose latents are scaled by ``sqrt(hidden_size / rank)``.

Choices:
- Each HF layer ``i`` is two megatron layers, ``2i`` and ``2i + 1`` (transformers' ``num_hidden_layers`` is
  ``2 * num_layers`` too): sublayer ``j`` of layer ``i`` is megatron layer ``2i + j``, its names HF's with ``.{j}``
  (``self_attn.{j}``, ``input_layernorm.{j}``, ``post_attention_layernorm.{j}``, ``mlps.{j}``;
  ``paired_sublayers.sublayer`` mappings).
- Attention: the MLA bridges' (``deepseek.MultiLatentAttention``: megatron's ``MLASelfAttention``, rotary pairs on
  disk), with the query after ``q_b_proj`` times ``sqrt(hidden_size / q_lora_rank)`` and the normalised KV latent
  times ``sqrt(hidden_size / kv_lora_rank)`` (``linear_q_up_proj`` / ``kv_layernorm`` re-classed to scale their
  output, as transformers scales: after the projection, before the rotation / the up projection).
- Even megatron layers: megatron's ``MoELayer`` (``ShortcutMoE``) whose shared expert is ``mlps.0`` and whose routed
  experts' output (plus the zero experts') is kept, not added: the odd layer's MLP (``mlps.1``, ``ShortcutMLP``) adds
  it to its own output, so the residual gets ``mlps.1 + moe`` as in transformers. The pair shares a box, so pipeline
  stages (a pair split), context parallelism and activation recompute (a recomputed layer would lose the box's graph)
  are refused by name.
- Routing is transformers' ``LongcatFlashTopkRouter`` (``route``, in ``BalanceRouter``'s route slot): fp32 logits
  over ``n_routed_experts + zero_expert_num`` (the router's weight ``[E + Z, H]`` in the model's dtype, as
  transformers keeps it, cast to fp32 for the logits), the softmax, the top ``moe_topk`` of it plus
  ``e_score_correction_bias`` (``[E + Z]``, fixed; an fp32 buffer, the model's dtype on disk), the chosen softmax scores
  times ``routed_scaling_factor``, never renormalised. megatron dispatches the first ``E`` columns, a token's
  zero-expert slots filled with unchosen real experts at probability 0 (``full_map``: its dispatchers count on
  ``moe_topk`` experts a token; their output counts 0 times, exactly, at the cost of computing it); a zero expert's
  output is its input times its weight. transformers' ``router_logits`` are ``[tokens, E + Z]``; no balancing loss.
- transformers' ``gate_up_proj`` holds rows for the zero experts too (``experts.{E..E+Z-1}.gate_proj`` / ``up_proj``
  on disk, never used): expected (transformers' loading info does not list them), passed through unchanged as
  ``model.mtp.*``, and read as zeros where a checkpoint lacks them (``optional_tensors``; transformers fails there).
- LoRA as PEFT adapts the transformers model: MLA's ``q_a_proj`` / ``q_b_proj`` / ``kv_a_proj_with_mqa`` /
  ``kv_b_proj`` / ``o_proj`` of both sublayers as plain megatron linears (the query scale is a forward hook on
  ``linear_q_up_proj``, so it scales the adapter's term too, as transformers scales ``q_b_proj``'s output; the KV
  latent's scale is the norm's, before ``kv_b_proj`` and its adapter alike), the routed experts' ``down_proj``
  (``target_parameters``, PEFT's rewrite of ``down_proj``: the MoE of HF layer ``i`` is megatron's ``2i``,
  ``lora_param_layer``). Refused by name: ``gate_up_proj`` (transformers' stack holds the zero experts' rows and
  PEFT's factors span them; PEFT's rewrite brings it in for ``gate_proj`` / ``up_proj`` and ``'all-linear'``), the
  router's ``classifier`` (``lora.plan._REFUSED``: transformers reads its weight itself, so PEFT's adapter never acts).
  PEFT's rewrite takes ``gate_proj`` / ``up_proj`` / ``down_proj`` from the modules, so ``mlps.{0,1}`` carry none.
"""

from __future__ import annotations

import copy
import functools
import re
import types

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import MultiLatentAttention
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import GatedMLP
from loongforge_hf.bridges.longcat_flash_layers import mlp_class, moe_class, refuse_recompute, route, scale_output
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.paired_sublayers import SUB, sublayer
from loongforge_hf.bridges.registry import register_bridge

ARCH = "LongcatFlashForCausalLM"
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


@register_bridge(ARCH)
class LongcatFlashBridge(MultiLatentAttention, MoEBridge):
    router_name = "router.classifier"
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss
    has_passthrough = True
    passthrough_kind = "the zero experts' unused gate_proj / up_proj rows, multi-token prediction"
    # NOTE: megatron applies these in the routing function ``route`` replaces (builder refuses them)
    unserved_megatron_fields = ("moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "moe_router_group_topk", "moe_router_fusion",
                                "moe_router_load_balancing_type", "moe_input_jitter_eps")

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if getattr(c, "router_bias", False):
            raise C.UnsupportedConfigError(f"router_bias={c.router_bias} is not supported for {ARCH} (transformers "
                                           "builds the bias and never adds it).")
        if c.attention_bias:
            raise C.UnsupportedConfigError(f"attention_bias={c.attention_bias} is not supported for {ARCH}.")
        if c.q_lora_rank is None:
            raise C.UnsupportedConfigError(f"q_lora_rank=None is not supported for {ARCH} (its query latent is "
                                           "scaled).")
        if c.qk_head_dim != c.qk_nope_head_dim + c.qk_rope_head_dim:
            raise C.UnsupportedConfigError(f"qk_head_dim={c.qk_head_dim} is not supported for {ARCH}: it must be "
                                           "qk_nope_head_dim + qk_rope_head_dim.")
        if c.num_key_value_heads != c.num_attention_heads:
            raise C.UnsupportedConfigError(f"num_key_value_heads={c.num_key_value_heads} is not supported for {ARCH} "
                                           f"(multi-latent attention: num_attention_heads={c.num_attention_heads}).")
        if not c.n_routed_experts or c.n_routed_experts < 1 or (c.zero_expert_num or 0) < 0:
            raise C.UnsupportedConfigError(f"n_routed_experts={c.n_routed_experts} / zero_expert_num="
                                           f"{c.zero_expert_num} are not supported for {ARCH}.")
        if not 1 <= c.moe_topk <= c.n_routed_experts:
            raise C.UnsupportedConfigError(f"moe_topk={c.moe_topk} is not supported for {ARCH}: between 1 and "
                                           f"n_routed_experts={c.n_routed_experts} (megatron dispatches moe_topk real "
                                           "experts a token).")
        super().check_config()

    def check_layout(self, layout) -> None:
        for name in ("pipeline_parallel_size", "context_parallel_size"):
            if getattr(layout, name) > 1:
                raise C.UnsupportedConfigError(f"{name}={getattr(layout, name)} is not supported for {ARCH} (each "
                                               "layer's MoE output passes between two megatron layers).")
        if layout.tensor_parallel_size > 1 and not layout.sequence_parallel:
            raise C.UnsupportedConfigError(f"tensor_parallel_size={layout.tensor_parallel_size} without "
                                           f"sequence_parallel is not supported for {ARCH}: pass "
                                           "sequence_parallel=True.")

    def transformer_config_kwargs(self) -> dict:
        # NOTE: transformers keeps classifier.weight in the model's dtype (its _keep_in_fp32_modules entry matches no
        # module) and computes the logits in fp32: megatron's router casts input and weight alike
        return {**super().transformer_config_kwargs(), "moe_router_dtype": "fp32"}

    def num_experts(self) -> int:
        return self.hf_config.n_routed_experts

    def router_width(self) -> int:
        return self.hf_config.n_routed_experts + (self.hf_config.zero_expert_num or 0)

    def expert_ffn_size(self) -> int:
        return self.hf_config.expert_ffn_hidden_size

    def shared_ffn_size(self) -> int:
        return self.hf_config.ffn_hidden_size                  # NOTE: mlps.0, megatron's shared expert

    def top_k(self) -> int:
        return self.hf_config.moe_topk

    def is_moe_layer(self, layer: int) -> bool:
        return layer % 2 == 0

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "softmax"}     # NOTE: ``route`` routes (module docstring)

    def moe_module(self) -> type:
        return moe_class()

    def mlp_module(self) -> type:
        return mlp_class()

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.layer_outputs import _rescale
        from loongforge_hf.bridges.router_balance import balance_router_class

        super().finish_model(model)
        c, width = self.hf_config, self.router_width()
        layers = list(model.decoder.layers)
        for even, odd in zip(layers[::2], layers[1::2]):
            even.mlp.box = odd.mlp.box = types.SimpleNamespace(zero=None, shortcut=None)
        for layer in layers:
            attention = layer.self_attention
            # NOTE: a hook, not a re-class: LoRA re-classes the linear (its adapter's term then scaled too, as
            # transformers scales q_b_proj's output, PEFT's term included)
            attention.linear_q_up_proj.register_forward_hook(
                functools.partial(scale_output, scale=(c.hidden_size / c.q_lora_rank) ** 0.5))
            _rescale(attention.kv_layernorm, (c.hidden_size / c.kv_lora_rank) ** 0.5)
        for router in model.modules():
            if isinstance(router, balance_router_class()):
                weight = router.weight
                router.weight = torch.nn.Parameter(weight.new_empty(width, weight.shape[1]))
                for k, v in vars(weight).items():  # NOTE: megatron's sequence_parallel flag and the like
                    setattr(router.weight, k, v)
                router.config = copy.copy(router.config)
                router.config.num_moe_experts = width
                del router.expert_bias  # NOTE: megatron's TopKRouter sets it to None without an expert bias
                router.register_buffer("expert_bias", torch.zeros(width, dtype=torch.float32,
                                                                  device=weight.device))
                router.route = types.MethodType(functools.partial(route, topk=c.moe_topk,
                                                                  scale=float(c.routed_scaling_factor)), router)
        model.decoder.register_forward_pre_hook(refuse_recompute)

    def checkpoint_name(self, name: str) -> str:
        """The LoRA planner's way to the checkpoint's names (transformers' own); ``gate_up_proj`` refused by name."""
        if name.endswith(".mlp.experts.gate_up_proj"):
            from loongforge_hf.lora.plan import LoraConfigError

            raise LoraConfigError(
                f"LoRA on {name} is not supported for {ARCH}: transformers' stack holds the zero experts' rows too "
                f"([n_routed_experts + zero_expert_num, 2 * expert_ffn_hidden_size, hidden_size]) and PEFT's factors "
                "span them (PEFT's rewrite adds it for 'gate_proj' / 'up_proj' and 'all-linear'); name the attention "
                "projections (target_modules=['q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj']) "
                "and the routed experts' down projection (target_parameters=['mlp.experts.down_proj']).")
        return name

    @staticmethod
    def lora_param_layer(hf_layer: int) -> int:
        """The megatron layer of HF layer ``hf_layer``'s MoE (its first sublayer): LoRA's parameter targets."""
        return 2 * hf_layer

    @property
    def optional_tensors(self) -> tuple[tuple[str, float], ...]:
        """The zero experts' unused rows: expected (transformers loads them into ``gate_up_proj``, so its loading
        info does not list them), read as zeros where a checkpoint lacks them (``optional_tensors.py``)."""
        zero = "|".join(str(e) for e in range(self.num_experts(), self.router_width()))
        return ((rf"\.mlp\.experts\.({zero})\.(gate|up)_proj\.weight$", 0.0),) if zero else ()

    def passthrough_names(self, names) -> list[str]:
        """The zero experts' unused ``gate_proj`` / ``up_proj`` rows and the multi-token-prediction ``model.mtp.*``."""
        routed = self.hf_config.n_routed_experts
        return [n for n in names if n.startswith("model.mtp.") or ((m := _EXPERT.match(n)) and int(m.group(1))
                                                                   >= routed)]

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [sublayer(m) for m in super().attention_mappings()]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [sublayer(m) for m in super().dense_mlp_mappings()]

    def moe_mappings(self) -> list[Mapping]:
        s, shared = f"{L}.mlp", f"{L}.mlps.{SUB}"
        return [sublayer(m) for m in super().moe_mappings()] + [sublayer(m) for m in (
            Replicated(f"{D}.mlp.router.expert_bias", f"{s}.router.e_score_correction_bias"),  # NOTE: model dtype
            GatedMLP(f"{D}.mlp.shared_experts.linear_fc1.weight", gate=f"{shared}.gate_proj.weight",
                     up=f"{shared}.up_proj.weight"),
            RowParallel(f"{D}.mlp.shared_experts.linear_fc2.weight", f"{shared}.down_proj.weight"))]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, prefix, sub = self.hf_config, f"model.layers.{layer // 2}", str(layer % 2)
        h = c.hidden_size
        shapes = {k.replace(SUB, sub): v for k, v in {
            **{f"{prefix}.{k}.{SUB}.weight": (h,) for k in ("input_layernorm", "post_attention_layernorm")},
            **{n.replace(".self_attn.", f".self_attn.{SUB}."): s for n, s in self.attention_shapes(prefix).items()
               if ".self_attn." in n},
            **{n.replace(".mlp.", f".mlps.{SUB}."): s for n, s in self.dense_mlp_shapes(prefix).items()
               if ".mlp." in n}}.items()}
        if self.is_moe_layer(layer):
            moe = self.moe_shapes(prefix)
            shapes.update({n: s for n, s in moe.items() if ".mlp.experts." in n})
            f, zero = self.expert_ffn_size(), range(self.num_experts(), self.router_width())
            shapes.update({f"{prefix}.mlp.experts.{e}.{p}.weight": (f, h) for e in zero
                           for p in ("gate_proj", "up_proj")})  # NOTE: the zero experts' (passed through)
            shapes.update({f"{prefix}.mlp.router.classifier.weight": (self.router_width(), h),
                           f"{prefix}.mlp.router.e_score_correction_bias": (self.router_width(),)})
        return shapes
