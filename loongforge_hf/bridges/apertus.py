"""ApertusForCausalLM (the Swiss AI Apertus-8B / 70B): Llama's attention with per-head q / k norms before the rotary
embedding (Qwen3's), pre-norms under other names, and an ungated MLP whose xIELU activation learns two scalars per
layer.

Choices:
- Norms: ``attention_layernorm`` / ``feedforward_layernorm`` are megatron's input / pre-MLP norms; q / k norms per
  head, megatron's ``qk_layernorm`` (Qwen3's).
- MLP: ``down_proj(act(up_proj(x)))`` without a gate (``ArceeBridge``'s: megatron's ``MLP`` without
  ``gated_linear_unit``). With ``hidden_act="xielu"`` (every hub checkpoint) the activation is ``XIELU`` (its
  parameters ``mlp.act_fn.alpha_p`` / ``alpha_n``, ``[1]`` each, and the buffers ``beta`` / ``eps``, scalars on disk,
  read and written as they are), transformers' Python expression op for op in the model's dtype, so fp32 results are
  transformers' to the bit (transformers' optional CUDA kernel, the ``xielu`` package, is not used). Each TP rank
  applies it to its share of the MLP's channels, so the two scalars' gradients are each rank's part of the sum:
  megatron's ``copy_to_tensor_model_parallel_region`` adds them up over the TP group in the backward, so every rank
  holds the whole gradient (as for a replicated norm without sequence parallelism). Any other ``hidden_act`` goes
  through the shared activation table without parameters.
- Rope: Apertus's llama3 scaling (its default), plain, or YaRN (its attention factor after the q / k norms, as
  Qwen3's). ``attention_bias`` / ``mlp_bias`` are refused by the shared dense checks.
- Apertus1p5TextForCausalLM (Apertus 1.5's language model, its vocabulary extended by visual and audio codes) is
  Apertus with an LM head that may be pruned to the first ``output_vocab_size`` rows: a full-width head is Apertus's;
  a pruned one (logits narrower than the embedding) is refused by name.
"""

from __future__ import annotations

import functools
import math

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.arcee import ArceeBridge
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import Mapping, Replicated, replaced, with_replaced_names
from loongforge_hf.bridges.registry import register_bridge

_NORMS = {".input_layernorm.": ".attention_layernorm.", ".post_attention_layernorm.": ".feedforward_layernorm."}
_XIELU_BUFFERS = ("beta", "eps")  # NOTE: scalars on disk; alpha_p / alpha_n are [1]
_XIELU = ("alpha_p", "alpha_n", *_XIELU_BUFFERS)


class XIELU(torch.nn.Module):
    """transformers' ``XIELUActivation`` (Python path): ``softplus``-parametrised ``alpha_p`` / ``alpha_n`` (``[1]``,
    learned), ``beta`` / ``eps`` (scalar buffers, as on disk), in the model's dtype."""

    def __init__(self, config) -> None:
        from loongforge_hf.xpu import get_backend

        super().__init__()
        kw = {"dtype": config.params_dtype,
              "device": torch.device("cpu") if config.use_cpu_initialization else get_backend().device()}
        # NOTE: transformers' initial values (alpha_p = alpha_n = 0.8, beta = 0.5); a checkpoint overwrites them
        self.alpha_p = torch.nn.Parameter(torch.full((1,), math.log(math.expm1(0.8)), **kw))
        self.alpha_n = torch.nn.Parameter(torch.full((1,), math.log(math.expm1(0.3)), **kw))
        self.register_buffer("beta", torch.tensor(0.5, **kw))
        self.register_buffer("eps", torch.tensor(-1e-6, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        # NOTE: identity forward; the backward sums the scalars' gradients over the TP ranks' channel shares
        alpha_p = torch.nn.functional.softplus(copy_to_tensor_model_parallel_region(self.alpha_p))
        alpha_n = self.beta + torch.nn.functional.softplus(copy_to_tensor_model_parallel_region(self.alpha_n))
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets)


@functools.cache
def xielu_mlp() -> type:
    """megatron's ungated ``MLP`` whose activation is an ``XIELU`` of its own (``act_fn``)."""
    from megatron.core.transformer.mlp import MLP

    class XIELUMLP(MLP):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            self.act_fn = XIELU(config)
            # NOTE: a bound method, not the module, so that it is not registered a second time
            self.activation_func = self.act_fn.forward

    return XIELUMLP


@register_bridge("ApertusForCausalLM")
class ApertusBridge(ArceeBridge):
    qk_norm = True

    @property
    def own_activation(self) -> bool:
        return self.hf_config.hidden_act == "xielu"

    @property
    def config_fields(self) -> tuple[C.Field, ...]:
        fields = C.DENSE_FIELDS
        return tuple(f for f in fields if f.hf != "hidden_act") if self.own_activation else fields

    def mlp_module(self) -> type | None:
        return xielu_mlp() if self.own_activation else None

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NORMS) for m in super().attention_mappings()]

    def dense_mlp_mappings(self) -> list[Mapping]:
        maps = [with_replaced_names(m, _NORMS) for m in super().dense_mlp_mappings()]
        if self.own_activation:
            maps += [Replicated(f"{D}.mlp.act_fn.{n}", f"{L}.mlp.act_fn.{n}") for n in _XIELU]
        return maps

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {replaced(n, _NORMS): shape for n, shape in super().attention_shapes(prefix).items()}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = {replaced(n, _NORMS): shape for n, shape in super().dense_mlp_shapes(prefix).items()}
        if self.own_activation:
            shapes.update({f"{prefix}.mlp.act_fn.{n}": () if n in _XIELU_BUFFERS else (1,) for n in _XIELU})
        return shapes


@register_bridge("Apertus1p5TextForCausalLM")
class Apertus1p5TextBridge(ApertusBridge):
    def check_config(self) -> None:
        c = self.hf_config
        pruned = getattr(c, "output_vocab_size", None)
        if pruned is not None and pruned != c.vocab_size:
            raise C.UnsupportedConfigError(
                f"output_vocab_size={pruned} (an LM head pruned below vocab_size={c.vocab_size}) is not supported for "
                "Apertus1p5TextForCausalLM: only a full-width head (output_vocab_size null).")
        super().check_config()
