"""LayerNorm (weight and bias) with Hugging Face's ``nn.LayerNorm`` numerics, as a module megatron-core builds from a
layer spec (StarCoder2's and GPT-NeoX's input, pre-MLP and final norms), without the bias (``LayerNormWithoutBias``:
Cohere's ``CohereLayerNorm``), and without weight or bias (``LayerNormWithoutParameters``: OLMo's ``OlmoLayerNorm``).

Choices:
- The forward is torch's ``F.layer_norm`` with the module's weight, bias and eps, the op ``nn.LayerNorm`` runs: the
  same results, bit for bit, in every dtype, and torch's fused kernels on every device (no Triton kernel of our own).
- ``LayerNormWithoutBias``: the same op with no bias (``F.layer_norm(x, ..., weight, None, eps)``), which is
  Cohere's norm: the mean subtracted, the biased variance, ``weight * (x - mean) * rsqrt(var + eps)``, computed in
  fp32 and rounded once to the input's dtype (torch's kernels accumulate in fp32 for 16-bit inputs).
- ``LayerNormWithoutParameters``: OLMo's norm, ``F.layer_norm`` of the input cast to fp32 with neither weight nor bias,
  rounded once to the input's dtype, as transformers writes it.
- ``config.layernorm_zero_centered_gamma`` (Nemotron's ``LayerNorm1P``): the stored weight is ``gamma - 1``
  (initialised at zero) and the forward uses ``weight + 1`` added in the weight's dtype, as transformers does.
- ``LayerNorm(config, hidden_size, eps)`` has the keyword contract megatron uses for every norm slot, as our
  ``RMSNorm``. Weight and bias carry ``sequence_parallel`` so megatron all-reduces their grads over the
  tensor-parallel group when sequence parallelism splits the tokens; megatron's own torch norm
  (``WrappedTorchNorm``) refuses that layout.
- ``copy_input``: as ``RMSNorm``'s (the builder sets it on the first layer's input norm for megatron's local CUDA
  graphs, ``bridges/builder._keep_graph_input``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_hf.xpu import get_backend


class LayerNorm(torch.nn.Module):
    """The norm for megatron's ``input_layernorm`` / ``pre_mlp_layernorm`` / final-norm slots of a config with
    ``normalization="LayerNorm"``: ``build_module(LayerNorm, config=config, hidden_size=..., eps=...)``."""

    with_weight = True
    with_bias = True

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        if getattr(config, "normalization", None) != "LayerNorm":
            raise ValueError(f"loongforge LayerNorm was built for a config with normalization="
                             f"{getattr(config, 'normalization', None)!r}; set TransformerConfig.normalization="
                             "'LayerNorm'.")
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        if self.zero_centered_gamma and not self.with_weight:
            raise ValueError("layernorm_zero_centered_gamma needs a norm weight; this LayerNorm has none.")
        self.hidden_size = hidden_size
        self.eps = eps
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device)) \
            if self.with_weight else None
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device)) \
            if self.with_bias else None
        # NOTE: with sequence parallelism each TP rank normalises different tokens, so each holds a partial grad
        # (megatron's finalize_model_grads sums the params marked `sequence_parallel` over the TP group)
        for p in (self.weight, self.bias):
            if p is not None:
                p.sequence_parallel = bool(config.sequence_parallel)
        self.copy_input = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = x.clone()
        if not self.with_weight:
            return F.layer_norm(x.to(torch.float32), (self.hidden_size,), None, None, self.eps).to(x.dtype)
        weight = self.weight + 1.0 if self.zero_centered_gamma else self.weight
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}" + ("" if self.with_weight else ", weight=False")
                + ("" if self.with_bias else ", bias=False") + (", zero_centered_gamma=True" if self.zero_centered_gamma
                                                                else ""))


class LayerNormWithoutBias(LayerNorm):
    """``LayerNorm`` with a weight only (Cohere's norms)."""

    with_bias = False


class LayerNormWithoutParameters(LayerNorm):
    """``LayerNorm`` with neither weight nor bias (OLMo's norms)."""

    with_weight = False
    with_bias = False
