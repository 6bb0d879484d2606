"""Which megatron layer spec a bridge's model is built from.

Choices:
- Dense decoders: our kernels' spec (``kernels/specs.py``): SDPA core attention (no materialised scores, GQA
  without repeated K/V, sliding windows, packed documents, context parallel) and our RMSNorm (HF numerics, sequence
  parallel; our LayerNorm where the config's ``normalization`` says so: StarCoder2), with megatron's parallel linears.
- MoE and MLA decoders: megatron's decoder block spec from the config (``moe_layer_freq`` says which layers are
  sparse, ``multi_latent_attention`` picks ``MLASelfAttention``), megatron's local linear, MoE and MLA modules,
  sliced to the layers this pipeline stage (and virtual stage) builds, with our kernels in three slots, as in the
  dense spec:
  - every norm (input, pre-MLP, q/k or MLA latent, final) is our ``kernels.rmsnorm.RMSNorm`` (the input, pre-MLP and
    final ones our LayerNorm where the config's ``normalization`` says so: PhiMoE; MLA's latent norms with
    transformers' eps for them, 1e-6, whatever ``rms_norm_eps`` is: ``LatentRMSNorm``): megatron's local torch norm
    refuses sequence parallelism, which megatron's MoE layer requires in training with TP > 1; the attention's
    output projection has a bias of its own where the bridge says ``proj_bias`` (PhiMoE's, experts without one);
  - core attention is our ``kernels.attention.CoreAttention`` (SDPA: no materialised ``[b, heads, s, s]`` scores,
    no fp32 softmax copy, GQA without repeated K/V); for MLA ``MLACoreAttention``, which takes the query/key head
    size ``k_channels`` and value head size ``v_channels`` MLA passes (SDPA accepts a value head size that differs),
    or the bridge's ``mla_core_attention`` spec (DeepSeek Sparse Attention: ``sparse_attention.py``);
  - the rotary embedding goes through the fused-rope slot (``rope.enable_megatron_fused_rope``; MLA keeps megatron's
    own rotary path, which the slot does not serve);
  - the router's top-k softmax routing is ``kernels.router.topk_softmax`` (one op; sigmoid / grouped / biased
    routing stays megatron's, but for softmax scores with an expert bias, ERNIE 4.5's: ``biased_routing.py``);
  - a dense layer's MLP (DeepSeek's first layers, Qwen3-MoE's ``mlp_only_layers``) is the dense spec's
    ``SwiGLUMLP`` (megatron's ``MLP`` with our ``swiglu``), or the bridge's ``mlp_module`` (AFMoE's post norm);
    shared experts stay megatron's ``SharedExpertMLP``;
  - with the bridge's ``parallel_residual`` every layer is the dense spec's parallel-residual layer
    (``kernels.specs.ParallelResidualLayer``; ``"shared"``: one norm before both sublayers, Cohere2-MoE's).
  And one more with ``bridge.grouped_experts`` (the default, see ``moe.py``): the routed experts of every MoE layer are
  our ``kernels.grouped_mlp.GroupedMLP`` instead of megatron's ``SequentialMLP``; with ``bridge.hf_router_logits`` the
  router is ``router_balance.BalanceRouter`` (megatron's ``TopKRouter`` that records its logits for transformers'
  ``router_logits`` and, with ``bridge.hf_balance_loss``, tallies transformers' balancing loss; routing unchanged).
- Token dispatcher: the bridges ask for megatron's ``alltoall`` dispatcher. Where the experts' process groups are
  trivial (expert parallel 1 and expert-tensor parallel 1) it moves no tokens, yet it still splits the permuted tokens
  into one chunk per expert and concatenates them back in an unchanged order (``sort_chunks_by_idxs``, with no
  Transformer Engine to fuse it): a copy of the ``[tokens * top-k, hidden]`` activations and of their probabilities
  in the dispatch and in the combine, and the same again in the backward. There ``layer_spec_for`` switches the
  config to megatron's ``allgather`` dispatcher, which has no chunk sort and communicates nothing over groups of one:
  the same permutation (tokens by expert, then by position), probabilities and scatter-add (the parity tests hold
  either way). Variable sequence lengths and router padding for quantization keep ``alltoall`` (megatron's allgather
  dispatcher refuses both).
- With a Transformer Engine FP8 recipe (``config.fp8`` set by the builder), the linear slots named in
  ``kernels.fp8_te.TE_SLOTS`` get megatron's TE linears, in the dense and in the MoE / MLA spec alike.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

_LAYER_NORMS = ("input_layernorm", "pre_mlp_layernorm")
_ATTENTION_NORMS = ("q_layernorm", "k_layernorm", "kv_layernorm")


def _mla_core_attention():
    from loongforge_hf.kernels.attention import CoreAttention

    class MLACoreAttention(CoreAttention):
        """Our SDPA core attention with query/key head size ``k_channels`` (the default softmax scale's) and value
        head size ``v_channels``; the output has ``heads * v_channels`` features (SDPA sizes it from the values)."""

        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if k_channels is not None and kwargs.get("softmax_scale") is None:
                self.head_dim = k_channels
                self.softmax_scale = 1.0 / math.sqrt(k_channels)

    return MLACoreAttention


@functools.cache
def _latent_norm():
    from loongforge_hf.bridges.config_map import MLA_LATENT_NORM_EPS
    from loongforge_hf.kernels.rmsnorm import RMSNorm

    class LatentRMSNorm(RMSNorm):
        """Our RMSNorm with transformers' eps for MLA's q / kv latents (its RMSNorm default), whatever the config's
        ``rms_norm_eps``, which megatron would pass (GLM-4.7-Flash: 1e-5 for the rest)."""

        def __init__(self, config, hidden_size: int, eps: float = MLA_LATENT_NORM_EPS) -> None:
            super().__init__(config, hidden_size, eps=MLA_LATENT_NORM_EPS)

    return LatentRMSNorm


def _moe_slots(mlp_spec, *, grouped_experts: bool, balance_router: bool, module: type | None = None):
    """An MoE layer's spec with ``GroupedMLP`` as its routed experts and / or ``BalanceRouter`` as its router, and
    ``module`` (a ``MoELayer`` subclass) in place of megatron's; any other MLP spec unchanged."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from loongforge_hf.bridges.router_balance import balance_router_class
    from loongforge_hf.kernels.grouped_mlp import GroupedMLP

    if getattr(mlp_spec, "module", None) is not MoELayer:
        return mlp_spec
    slots = {"experts": ModuleSpec(module=GroupedMLP)} if grouped_experts else {}
    if balance_router:
        slots["router"] = balance_router_class()
    return replace(mlp_spec, module=module or MoELayer, submodules=replace(mlp_spec.submodules, **slots))


def _biased_linear_proj():
    """megatron's ``RowParallelLinear`` with a bias whatever ``add_bias_linear`` says (the attention's output
    projection of a model whose MLPs have none: PhiMoE's ``o_proj``)."""
    from megatron.core.tensor_parallel import RowParallelLinear

    class BiasedRowParallelLinear(RowParallelLinear):
        lora_adaptable = True  # NOTE: megatron's linear with its bias: LoRA's term joins the partial output as there

        def __init__(self, *args, bias: bool = True, **kwargs) -> None:
            super().__init__(*args, bias=True, **kwargs)

    return BiasedRowParallelLinear


def _swap_modules(block_spec, *, grouped_experts: bool = False, balance_router: bool = False,
                  qk_module: type | tuple[type, type] | None = None, attention_module: type | None = None,
                  moe_module: type | None = None, pre_norms: bool = True, layer_norm: type | None = None,
                  proj_bias: bool = False, mlp_module: type | None = None, parallel_residual: str | None = None,
                  pre_mlp_norm: bool = True, mla_core_attention=None):
    """``block_spec`` with our RMSNorm (``layer_norm``: another of our norms, for the input / pre-MLP / final
    norms) in every norm slot and our core attention (see the docstring); ``proj_bias``: a bias on the attention's
    output projection alone (``_biased_linear_proj``); ``qk_module``
    (YaRN's attention factor on the rotary channels, ``DenseBridge.qk_module``) in both q / k norm slots, or a (q, k)
    pair (OLMoE's norms over all heads); ``attention_module`` (``DenseBridge.attention_module``: Llama 4's) for
    megatron's ``SelfAttention``; ``moe_module`` (``MoEBridge.moe_module``: FlexOlmo's post norm) for its
    ``MoELayer``; without ``pre_norms`` no input / pre-MLP norms (FlexOlmo normalises the sublayers' outputs);
    ``mlp_module``: a dense layer's MLP class (``DenseBridge.mlp_module``); ``parallel_residual``: ``"separate"`` or
    ``"shared"``, the MLP beside the attention (``kernels.specs.ParallelResidualLayer``); without ``pre_mlp_norm``
    no pre-MLP norm alone (the MLP / MoE layer reads the residual stream and normalises itself: Gemma 4's MoE);
    ``mla_core_attention``: a spec for MLA's core-attention slot (DeepSeek-V3.2's sparse attention)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from loongforge_hf.kernels.attention import CoreAttention
    from loongforge_hf.kernels.rmsnorm import RMSNorm
    from loongforge_hf.kernels.specs import ParallelResidualLayer, SharedNormParallelLayer, SwiGLUMLP

    layer_module = {None: None, "separate": ParallelResidualLayer, "shared": SharedNormParallelLayer}[
        parallel_residual]
    mla_core, latent_norm = mla_core_attention or _mla_core_attention(), _latent_norm()
    layer_norm = layer_norm or RMSNorm
    layers = []
    for spec in block_spec.layer_specs:
        attention = spec.submodules.self_attention
        att_sub = attention.submodules
        mla = attention.module is MLASelfAttention
        norms = {n: latent_norm if mla else RMSNorm for n in _ATTENTION_NORMS
                 if hasattr(att_sub, n) and getattr(att_sub, n) not in (None, IdentityOp)}
        if qk_module is not None:
            q, k = qk_module if isinstance(qk_module, tuple) else (qk_module,) * 2
            norms.update(q_layernorm=q, k_layernorm=k)
        norms["core_attention"] = mla_core if attention.module is MLASelfAttention else CoreAttention
        attention = replace(attention, submodules=replace(att_sub, **norms))
        if attention_module is not None and attention.module is not MLASelfAttention:
            attention = replace(attention, module=attention_module)
        if proj_bias:
            attention = replace(attention, submodules=replace(attention.submodules,
                                                              linear_proj=_biased_linear_proj()))
        slots = {n: layer_norm if pre_norms else IdentityOp for n in _LAYER_NORMS
                 if getattr(spec.submodules, n) is not IdentityOp}
        if parallel_residual == "shared":
            slots["pre_mlp_layernorm"] = IdentityOp  # NOTE: the MLP reads the input norm's output again
        if not pre_mlp_norm:
            slots["pre_mlp_layernorm"] = IdentityOp
        mlp = spec.submodules.mlp
        if getattr(mlp, "module", None) is MLP:
            slots["mlp"] = replace(mlp, module=mlp_module or SwiGLUMLP)
        elif grouped_experts or balance_router or moe_module is not None:
            slots["mlp"] = _moe_slots(mlp, grouped_experts=grouped_experts, balance_router=balance_router,
                                      module=moe_module)
        layers.append(replace(spec, module=layer_module or spec.module,
                              submodules=replace(spec.submodules, self_attention=attention, **slots)))
    return replace(block_spec, layer_specs=layers, layer_norm=layer_norm)


def _dispatcher_for_layout(config) -> None:
    """``allgather`` instead of ``alltoall`` where the experts' groups are single ranks (see the docstring)."""
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if (config.moe_token_dispatcher_type == "alltoall" and config.expert_model_parallel_size == 1 and etp == 1
            and not config.variable_seq_lengths and not config.moe_router_padding_for_quantization):
        config.moe_token_dispatcher_type = "allgather"


def layer_spec_for(bridge, config, *, vp_stage: int | None = None):
    """This stage's block spec (see the module docstring), every layer built by ``bridge.layer_module()`` where the
    bridge has one (Nemotron-H's layers of one mixer or one MLP each: ``nemotron_h.py``)."""
    block = _block_spec_for(bridge, config, vp_stage=vp_stage)
    layer = getattr(bridge, "layer_module", lambda: None)()
    if layer is None:
        return block
    return replace(block, layer_specs=[replace(spec, module=layer) for spec in block.layer_specs])


def _block_spec_for(bridge, config, *, vp_stage: int | None = None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if bridge.num_experts() is None and not getattr(config, "multi_latent_attention", False):
        from loongforge_hf.kernels.specs import get_block_spec, get_layer_spec

        norms = {"norm_bias": getattr(bridge, "norm_bias", True), "norm_weight": getattr(bridge, "norm_weight", True)}
        spec = get_layer_spec(qk_norm=bridge.qk_norm, qk_module=bridge.qk_module(),
                              attention_module=bridge.attention_module(), mlp_module=bridge.mlp_module(),
                              pre_norms=bridge.pre_norms, normalization=config.normalization, **norms,
                              parallel_residual=getattr(bridge, "parallel_residual", None))
        return _with_te_linears(config, get_block_spec(config, spec, vp_stage=vp_stage, **norms))
    from loongforge_hf.kernels.rope import enable_megatron_fused_rope
    from loongforge_hf.kernels.specs import norm_class

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    enable_megatron_fused_rope(config)  # changes nothing for MLA
    if config.num_moe_experts:
        _dispatcher_for_layout(config)
        from loongforge_hf.kernels.moe_permute import enable_megatron_fused_permute

        enable_megatron_fused_permute(config)  # after the dispatcher choice: it serves only some paths
        from loongforge_hf.kernels.router import enable_megatron_fused_router

        enable_megatron_fused_router()
    qk_module = None if config.multi_latent_attention else bridge.qk_module()  # NOTE: MLA's YaRN is megatron's
    return _with_te_linears(config, _swap_modules(block, grouped_experts=getattr(bridge, "grouped_experts", False),
                                                  balance_router=getattr(bridge, "hf_router_logits", False),
                                                  qk_module=qk_module,
                                                  attention_module=None if config.multi_latent_attention
                                                  else bridge.attention_module(),
                                                  moe_module=getattr(bridge, "moe_module", lambda: None)(),
                                                  pre_norms=getattr(bridge, "pre_norms", True),
                                                  layer_norm=norm_class(config.normalization,
                                                                        bias=getattr(bridge, "norm_bias", True)),
                                                  proj_bias=getattr(bridge, "proj_bias", False),
                                                  mlp_module=getattr(bridge, "mlp_module", lambda: None)(),
                                                  parallel_residual=getattr(bridge, "parallel_residual", None),
                                                  pre_mlp_norm=getattr(bridge, "pre_mlp_norm", True),
                                                  mla_core_attention=getattr(bridge, "mla_core_attention",
                                                                             lambda: None)()))


def _with_te_linears(config, block_spec):
    """Transformer Engine's linears in the eligible slots where the config asks for TE's FP8 (``kernels.fp8_te``)."""
    if not config.fp8:
        return block_spec
    from loongforge_hf.kernels.fp8_te import te_block_spec

    return te_block_spec(block_spec)
