"""NemotronHForCausalLM (NVIDIA Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): layers of one kind each
(``layers_block_type``: Mamba2, attention, a relu2 MLP, or a mixture of relu2 experts), each a pre-norm, the one
mixer or MLP, and the residual add.

Choices:
- One HF layer is one megatron ``TransformerLayer`` (so pipeline stages split the HF layers as they are), built by
  ``layer_module`` with the other half's slots empty, as megatron-core's own hybrid stack builds its layers
  (``ssm/mlp_layer.py``): a Mamba2 or attention layer has no pre-MLP norm, MLP nor its residual add (megatron's
  ``IdentityOp`` / ``IdentityFuncOp``: the hidden states pass unchanged), an MLP or MoE layer no input norm, attention
  nor its residual add. The layer's ``norm`` is megatron's input norm or its pre-MLP norm accordingly.
- Mamba2 layers: our ``Mamba2Mixer`` in the self-attention slot (``mamba2_layers.py``, as Granite 4.0 H's and
  Bamba's: TP by heads and groups, padding, packed documents, cached generate, context parallelism); transformers'
  Nemotron-H mixer clamps its time steps to ``(time_step_min, inf)`` whatever ``time_step_limit`` says: so do we.
- Attention layers: megatron's ``SelfAttention`` (GQA, ``head_dim``) without rotary embedding (transformers' has none:
  megatron's ``position_embedding_type="none"``), no biases (transformers builds none, whatever ``attention_bias``).
- MLP layers: ``up_proj``, relu2, ``down_proj``: megatron's ``MLP`` without ``gated_linear_unit``.
- MoE layers: ``n_routed_experts`` relu2 experts, our grouped MLP's plain (not gated) stacks (``GroupedMLP`` with
  ``gated_linear_unit=False``: fc1 ``[local experts, F / etp, H]``, ``up_proj`` rows; megatron's ``SequentialMLP``
  with ``LOONGFORGE_MOE_GROUPED_GEMM=0``), on disk one ``experts.{e}.up_proj`` / ``down_proj`` per expert, read and
  written expert by expert with the dense MLP's column / row split (``StackedExpert``); the shared expert
  (``moe_shared_expert_intermediate_size``) as megatron's shared experts; DeepSeek-V3's routing
  (``deepseek.sigmoid_routing_kwargs``: sigmoid scores plus the fixed fp32 ``gate.e_score_correction_bias``, top-2-sum
  group scores with ``n_group`` / ``topk_group``, renormalised, times ``routed_scaling_factor``), the router in fp32;
  transformers' ``router_logits``.
- LoRA (``lora/plan.py``): PEFT names the modules as transformers' tree does (``model.layers.N.mixer.q_proj``), the
  checkpoint ``backbone.layers.N.mixer.q_proj`` (``checkpoint_name``); the Mamba2 ``in_proj`` is adapted by its
  sections' rows, refused where TP exceeds ``n_groups``. The routed experts' stacks (``experts.up_proj`` /
  ``down_proj`` parameters) are refused as LoRA targets (``lora/param_targets.py``, ``lora/experts.py``); FP8
  (``fp8="on"``) leaves them in the model's dtype (``fp8_linear.fp8_experts_refusal``: SwiGLU experts only).
- Multi-token-prediction tensors (``mtp.*``, ``num_nextn_predict_layers``): transformers skips them on load; here too
  (not built), and ``save_pretrained`` copies them unchanged from the source folder, as Qwen3.5's.
- Refused before any collective: ``moe_latent_size`` (latent projections around the experts), ``use_bias``
  (``in_proj`` / ``out_proj`` biases), ``mlp_bias``, ``mamba_hidden_act`` other than silu, ``layers_block_type``
  kinds other than the four, and what ``mamba2_layers.py`` refuses (the static cache among them).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import sigmoid_routing_kwargs
from loongforge_hf.bridges.dense import D, DenseBridge
from loongforge_hf.bridges.fused_mappings import Expert
from loongforge_hf.bridges.mamba2_layers import MAMBA, BackboneEnds, Mamba2Layers
from loongforge_hf.bridges.mappings import ColumnParallel, FP32Replicated, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.moe import EXPERT, MoEBridge, StackedExpert
from loongforge_hf.bridges.registry import register_bridge

B = "backbone.layers.{layer}"
X = f"{B}.mixer"
ATTENTION, MLP, MOE = "full_attention", "mlp", "moe"


@register_bridge("NemotronHForCausalLM")
class NemotronHBridge(BackboneEnds, Mamba2Layers, MoEBridge):
    per_layer_types = True  # NOTE: layers_block_type checked here
    position_embedding_type = "none"
    router_fp32 = True
    expert_bias = True
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss
    has_passthrough = True
    shared_experts = "shared_experts"
    config_fields = tuple(replace(f, hf="mlp_hidden_act") if f.hf == "hidden_act" else f
                          for f in C.fields_with_eps("layer_norm_epsilon"))
    mamba_layer, mamba_module, mamba_norm = B, "mixer", "norm"
    mamba_fields = ("mamba_num_heads", "n_groups")

    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        if not self.moe_layers:
            self.hf_router_logits = False

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        kinds = list(c.layers_block_type)
        unknown = sorted(set(kinds) - {MAMBA[0], ATTENTION, MLP, MOE})
        if unknown:
            raise C.UnsupportedConfigError(f"layers_block_type {unknown} is not supported for {arch}: one of "
                                           f"{[MAMBA[0], ATTENTION, MLP, MOE]} per layer.")
        C.refuse_set_fields(c, arch, (("moe_latent_size", "latent projections around the experts"),
                                      ("use_bias", "biases of the Mamba2 in_proj / out_proj"),
                                      ("mlp_bias", "MLP biases")))
        if c.mamba_hidden_act != "silu":
            raise C.UnsupportedConfigError(f"mamba_hidden_act={c.mamba_hidden_act!r} is not supported for {arch} "
                                           "(only 'silu': the Mamba2 conv and gated norm use it).")
        C.check_dense_config(c, qkv_bias=True, check_rope=False, layer_types=True, activation=False)
        C.hf_to_megatron(c, self.config_fields)  # NOTE: refuses an unknown mlp_hidden_act, naming it
        self.check_mamba_dims()
        if self.moe_layers:
            self.routing_kwargs()

    @property
    def moe_layers(self) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.hf_config.layers_block_type) if kind == MOE)

    def num_experts(self) -> int | None:
        return self.hf_config.n_routed_experts if self.moe_layers else None

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def shared_ffn_size(self) -> int:
        return self.hf_config.moe_shared_expert_intermediate_size

    def routing_kwargs(self) -> dict:
        return sigmoid_routing_kwargs(self.hf_config)

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs() if self.moe_layers else DenseBridge.transformer_config_kwargs(self)
        kw.pop("window_size", None)  # NOTE: transformers' attention ignores sliding_window
        return {**kw, "gated_linear_unit": False}

    def mamba_dims(self) -> dict:
        c = self.hf_config
        return dict(heads=c.mamba_num_heads, head_dim=c.mamba_head_dim, groups=c.n_groups, d_state=c.ssm_state_size,
                    conv_kernel=c.conv_kernel, conv_bias=bool(c.use_conv_bias), chunk_size=c.chunk_size,
                    time_step_limit=(c.time_step_min, float("inf")), eps=c.layer_norm_epsilon)

    def layer_module(self) -> type:
        return nemotron_h_layer(tuple(self.hf_config.layers_block_type))

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of transformers' module tree, which loads ``backbone.*`` as
        ``model.*`` (``model.layers.0.mixer.in_proj.weight`` -> ``backbone.layers.0.mixer.in_proj.weight``): PEFT's
        names stay the module tree's (``lora/plan.py``)."""
        return "backbone." + name.removeprefix("model.") if name.startswith("model.") else name

    def passthrough_names(self, names) -> list[str]:
        """The checkpoint's multi-token-prediction tensors (``mtp.*``), not built."""
        return [n for n in names if n.startswith("mtp.")]

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        from loongforge_hf.bridges.fused_mappings import QKV

        a = f"{D}.self_attention"
        return [Replicated(f"{D}.input_layernorm.weight", f"{B}.norm.weight"),
                QKV(f"{a}.linear_qkv.weight", q=f"{X}.q_proj.weight", k=f"{X}.k_proj.weight", v=f"{X}.v_proj.weight"),
                RowParallel(f"{a}.linear_proj.weight", f"{X}.o_proj.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{B}.norm.weight"),
                ColumnParallel(f"{D}.mlp.linear_fc1.weight", f"{X}.up_proj.weight"),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{X}.down_proj.weight")]

    def routed_expert_mappings(self) -> list[Mapping]:
        """Each expert's ``up_proj`` / ``down_proj`` as a plain MLP's fc1 / fc2: onto the grouped MLP's stacks, or
        megatron's ``SequentialMLP`` experts."""
        experts = f"{D}.mlp.experts"
        local = f"{experts}.local_experts.{EXPERT}"
        fc1 = ColumnParallel(f"{local}.linear_fc1.weight", f"{X}.experts.{EXPERT}.up_proj.weight")
        fc2 = RowParallel(f"{local}.linear_fc2.weight", f"{X}.experts.{EXPERT}.down_proj.weight")
        if not self.grouped_experts:
            return [Expert(fc1), Expert(fc2)]
        n = self.num_experts()
        return [StackedExpert(fc1, f"{experts}.linear_fc1.weight", n),
                StackedExpert(fc2, f"{experts}.linear_fc2.weight", n)]

    def moe_mappings(self) -> list[Mapping]:
        shared = f"{D}.mlp.shared_experts"
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{B}.norm.weight"),
                FP32Replicated(f"{D}.mlp.router.weight", f"{X}.gate.weight"),
                FP32Replicated(f"{D}.mlp.router.expert_bias", f"{X}.gate.e_score_correction_bias"),
                *self.routed_expert_mappings(),
                ColumnParallel(f"{shared}.linear_fc1.weight", f"{X}.shared_experts.up_proj.weight"),
                RowParallel(f"{shared}.linear_fc2.weight", f"{X}.shared_experts.down_proj.weight")]

    def layer_mappings(self) -> list[Mapping]:
        maps = self.attention_mappings() + self.mamba_mappings()[1:] + self.dense_mlp_mappings()
        return maps + (self.moe_mappings()[1:] if self.moe_layers else [])

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        kind = self.hf_config.layers_block_type[layer]
        return {MAMBA[0]: self.mamba_mappings, ATTENTION: self.attention_mappings, MLP: self.dense_mlp_mappings,
                MOE: self.moe_mappings}[kind]()

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, B.format(layer=layer)
        kind, h, x = c.layers_block_type[layer], c.hidden_size, f"{p}.mixer"
        if kind == MAMBA[0]:
            return self.mamba_shapes(p)
        shapes = {f"{p}.norm.weight": (h,)}
        if kind == ATTENTION:
            heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            return {**shapes, f"{x}.q_proj.weight": (heads * hd, h), f"{x}.k_proj.weight": (kv * hd, h),
                    f"{x}.v_proj.weight": (kv * hd, h), f"{x}.o_proj.weight": (h, heads * hd)}
        if kind == MLP:
            return {**shapes, f"{x}.up_proj.weight": (c.intermediate_size, h),
                    f"{x}.down_proj.weight": (h, c.intermediate_size)}
        f, fs, n = c.moe_intermediate_size, self.shared_ffn_size(), c.n_routed_experts
        shapes.update({f"{x}.gate.weight": (n, h), f"{x}.gate.e_score_correction_bias": (n,),
                       f"{x}.shared_experts.up_proj.weight": (fs, h), f"{x}.shared_experts.down_proj.weight": (h, fs)})
        for e in range(n):
            shapes.update({f"{x}.experts.{e}.up_proj.weight": (f, h), f"{x}.experts.{e}.down_proj.weight": (h, f)})
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        shapes = {"backbone.embeddings.weight": (v, h), "backbone.norm_f.weight": (h,)}
        if not self.tied:
            shapes["lm_head.weight"] = (v, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes


@functools.cache
def nemotron_h_layer(kinds: tuple[str, ...]) -> type:
    """The layer class: megatron's ``TransformerLayer`` with the MLP's slots empty on the mixer layers of ``kinds``
    (0-based) and the attention's on the MLP / MoE layers. megatron's block numbers a stage's layers from 1; the
    layer adds its stage's offset (``TransformerLayer.__init__``), and so does the choice here."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    class NemotronHLayer:
        def __new__(cls, config, submodules, layer_number: int = 1, **kwargs):
            pp = (kwargs.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()).pp
            offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"), get_pg_rank(pp))
            if kinds[layer_number - 1 + offset] in (MLP, MOE):
                submodules = replace(submodules, input_layernorm=IdentityOp, self_attention=IdentityOp,
                                     self_attn_bda=IdentityFuncOp)
            else:
                submodules = replace(submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
            return TransformerLayer(config, submodules, layer_number, **kwargs)

    return NemotronHLayer
