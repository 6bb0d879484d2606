"""Olmo2ForCausalLM (AllenAI's OLMo 2) and Olmo3ForCausalLM (OLMo 3: OLMo 2 with sliding-window layers): the Llama
tensor layout with the norms moved after the sublayers.

Choices:
- No input / pre-MLP norms; the attention's and the MLP's outputs are normalised before the residual adds
  (``post_attention_layernorm`` / ``post_feedforward_layernorm``, ``layer_outputs.transformed_attention`` / ``_mlp``).
- q / k norms over the whole projection (all heads' channels at once, ``[heads * head_dim]`` weights), not per head:
  ``full_width_norm`` in megatron's q / k norm slots. Under tensor parallelism each rank holds its heads' channels
  and its slice of the weight (split like the heads); the sum of squares is added up over the TP group, forward and
  backward, so every rank normalises by the whole projection's mean. megatron's ``qk_layernorm`` stays off, so its
  ``finalize_model_grads`` does not sum these sliced weights' grads over TP as it does per-head norms'.
- OLMo 2's norms round once (``(weight * x_fp32 * rstd).to(dtype)``); the post norms here use Llama's numerics (the
  normalised input rounded before the weight multiply): the same in fp32, one bf16 rounding apart in bf16.
- OLMo 2: plain rope or llama3 scaling; YaRN is refused. OLMo 3: see ``Olmo3Bridge``.
"""

from __future__ import annotations

import functools

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.layer_outputs import transformed_attention, transformed_mlp
from loongforge_hf.bridges.layer_types import LayerTypes, layer_windows
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.registry import register_bridge


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group``; the backward sums the grads the same way (each rank's output feeds only that
    rank's heads, so every input's grad is the sum of all ranks' output grads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


@functools.cache
def full_width_norm(which: str, *, round_first: bool = False) -> type:
    """The q (``which="q"``) or k norm slot's module: RMSNorm over all heads of the projection; OLMo 2's numerics (one
    rounding) or, with ``round_first``, Llama's (the normalised input rounded before the weight multiply: OLMoE).
    ``which="width"``: an RMSNorm over the last axis of ``hidden_size`` channels split over TP (BitNet's sub-norms on
    the row-parallel linears' inputs)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from loongforge_hf.xpu import get_backend

    class FullWidthRMSNorm(torch.nn.Module):
        def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
            super().__init__()
            heads = {"q": config.num_attention_heads, "k": config.num_query_groups}.get(which, 1)
            self.tp = config.tensor_model_parallel_size
            self.full = heads * hidden_size  # NOTE: megatron passes the head size
            self.eps = eps
            device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
            self.weight = torch.nn.Parameter(torch.ones(self.full // self.tp, dtype=config.params_dtype,
                                                        device=device))
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shape = x.shape  # NOTE: [..., local heads, head_dim] ([..., local channels] for "width")
            flat = (x if which == "width" else x.reshape(*shape[:-2], -1)).to(torch.float32)
            squares = flat.pow(2).sum(-1, keepdim=True)
            if self.tp > 1:
                squares = _SumOverGroup.apply(squares, ps.get_tensor_model_parallel_group())
            normed = flat * torch.rsqrt(squares / self.full + self.eps)
            if round_first:
                return (self.weight * normed.to(x.dtype)).reshape(shape)
            return (self.weight.to(torch.float32) * normed).to(x.dtype).reshape(shape)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                       {"weight": 0}, sharded_offsets)

    FullWidthRMSNorm.__name__ = f"FullWidth{which.upper()}Norm"
    return FullWidthRMSNorm


class FullWidthQKNorms:
    """Mixin for a bridge whose q / k RMSNorms span all heads' channels with Llama's rounding (OLMoE, MiniMax-M2):
    ``full_width_norm`` in megatron's q / k norm slots, split over TP like the heads, megatron's ``qk_layernorm``
    off (it would sum the TP-split weights' grads over TP)."""

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "qk_layernorm": False}

    def qk_module(self) -> tuple[type, type]:
        return full_width_norm("q", round_first=True), full_width_norm("k", round_first=True)

    def attention_mappings(self) -> list[Mapping]:
        return [*super().attention_mappings(),
                ColumnParallel(f"{D}.self_attention.q_layernorm.weight", f"{L}.self_attn.q_norm.weight"),
                ColumnParallel(f"{D}.self_attention.k_layernorm.weight", f"{L}.self_attn.k_norm.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        hd = C.head_dim_of(c)
        return {**super().attention_shapes(prefix), f"{prefix}.self_attn.q_norm.weight": (c.num_attention_heads * hd,),
                f"{prefix}.self_attn.k_norm.weight": (C.kv_heads_of(c) * hd,)}


class PostNorms(DenseBridge):
    """No input / pre-MLP norms; the attention's and the MLP's outputs normalised before the residual adds
    (``post_attention_layernorm``, ``post_feedforward_layernorm``), q / k norms: OLMo 2, EXAONE 4."""

    qk_norm = True
    pre_norms = False
    qk_norm_mapping: type = Replicated  # per-head q / k norms (OLMo 2's span all heads: split over TP)

    def attention_module(self) -> type | None:
        return transformed_attention(post_norm=True)

    def mlp_module(self) -> type | None:
        return transformed_mlp(post_norm=True)

    def attention_mappings(self) -> list[Mapping]:
        norm = self.qk_norm_mapping
        return [
            QKV(f"{D}.self_attention.linear_qkv.weight", q=f"{L}.self_attn.q_proj.weight",
                k=f"{L}.self_attn.k_proj.weight", v=f"{L}.self_attn.v_proj.weight"),
            RowParallel(f"{D}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight"),
            norm(f"{D}.self_attention.q_layernorm.weight", f"{L}.self_attn.q_norm.weight"),
            norm(f"{D}.self_attention.k_layernorm.weight", f"{L}.self_attn.k_norm.weight"),
            Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
        ]

    def dense_mlp_mappings(self) -> list[Mapping]:
        _, fc1, fc2 = super().dense_mlp_mappings()
        return [fc1, fc2, Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_feedforward_layernorm.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().attention_shapes(prefix)
        shapes.pop(f"{prefix}.input_layernorm.weight")
        return {**shapes, f"{prefix}.post_attention_layernorm.weight": (self.hf_config.hidden_size,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().dense_mlp_shapes(prefix)
        h = shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return {**shapes, f"{prefix}.post_feedforward_layernorm.weight": h}


@register_bridge("Olmo2ForCausalLM")
class Olmo2Bridge(PostNorms):
    extra_rope_types = ()
    qk_norm_mapping = ColumnParallel

    def transformer_config_kwargs(self) -> dict:
        # NOTE: the q / k norm modules come from the spec (qk_module); megatron's qk_layernorm flag would make
        # finalize_model_grads sum their grads over TP, which is right for per-head norms (replicated) and wrong
        # for these (each rank holds its own heads' slice)
        return {**super().transformer_config_kwargs(), "qk_layernorm": False}

    def qk_module(self) -> tuple[type, type]:
        return full_width_norm("q"), full_width_norm("k")

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        hd, heads = C.head_dim_of(c), c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        return {**super().attention_shapes(prefix), f"{prefix}.self_attn.q_norm.weight": (heads * hd,),
                f"{prefix}.self_attn.k_norm.weight": (kv * hd,)}


@register_bridge("Olmo3ForCausalLM")
class Olmo3Bridge(LayerTypes, Olmo2Bridge):
    """OLMo 3: OLMo 2 with sliding-window layers (``layer_types``; three of four in OLMo-3-7B) and per-kind rope
    (``layer_types.LayerTypes``); YaRN on the full layers (OLMo 3's long-context setting): its frequencies as those
    layers' table, its attention factor on their q / k norm outputs (the rotation covers whole heads)."""

    supports_sliding_window = True
    extra_rope_types = ("linear", "yarn")

    def check_config(self) -> None:
        super().check_config()
        self.check_layer_types()
        if self._attention_factor("sliding_attention") != 1.0:
            raise C.UnsupportedConfigError("rope_parameters['sliding_attention'] with an attention factor (YaRN) is "
                                           "not supported; the full layers' may have one.")

    def _attention_factor(self, kind: str) -> float:
        from loongforge_hf.kernels.rope import rope_attention_factor

        return rope_attention_factor(self.rope_for(kind), self.hf_config.max_position_embeddings)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), **layer_windows(self.hf_config)}

    def attention_module(self) -> type | None:
        return transformed_attention(post_norm=True, sliding_layers=self.sliding_layers,
                                     full_qk_scale=self._attention_factor("full_attention"))

    def finish_model(self, model) -> None:
        self.set_rotary_tables(model)
