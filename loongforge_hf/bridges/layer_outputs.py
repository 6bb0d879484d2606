"""Changes to what megatron's modules output, for architectures that differ from Llama's there (Gemma's post norms and
scaled embedding, Granite's multipliers), as module classes a layer spec takes or a built model is re-classed to.

Choices:
- Attention and MLP outputs: ``transformed_attention`` / ``transformed_mlp`` subclass megatron's ``SelfAttention`` and
  the dense spec's ``SwiGLUMLP`` and transform their output after ``linear_proj`` / ``linear_fc2`` (so after LoRA's
  terms on them): a norm (``post_norm``: our ``RMSNorm``, the state dict's ``post_layernorm``) and / or a constant
  factor, before megatron's own bias-dropout-add with the residual. Under sequence parallelism they transform the
  tokens of their rank, as the input norms do. ``transformed_mlp(gate_scale=)``: the gate times a factor inside the
  activation, ``silu(gate * gate_scale) * up`` (Falcon-H1's first MLP multiplier), as transformers computes it.
- MoE outputs: ``transformed_moe`` subclasses megatron's ``MoELayer`` the same way (a post norm: FlexOlmo's; a
  factor: Cohere2-MoE's halved sum of routed and shared experts).
- ``scale_sublayer_outputs`` re-classes a built chunk's attention and MLP / MoE layers to multiply their output (for
  specs whose modules are megatron's own: the MoE spec).
- ``scale_embedding`` / ``scale_final_norm`` re-class a built chunk's embedding / final norm to multiply their
  output by a Python float (one rounding of the product, as transformers' multiply by a float or a same-dtype scalar).
- ``scale_logits`` / ``softcap_logits``: the output layer's logits multiplied by a Python float (Cohere's
  ``logit_scale``: the same rounding as transformers' multiply) / soft-capped (Gemma 2), and the fused training
  loss's the same way (``runtime.fused_loss_sum`` reads the chunk's ``logit_scale`` / ``logit_softcap``).
- ``sliding_layers``: for a model with two rotary tables side by side (``layer_types._two_table_rotary``), the
  layers that take the second half.
"""

from __future__ import annotations

import functools

import torch


def _transform(output_with_bias, norm, scale: float):
    out, bias = output_with_bias
    if bias is not None:
        out = out + bias
    if norm is not None:
        out = norm(out)
    return (out * scale if scale != 1.0 else out), None


def _rope_half(emb, second: bool):
    """A layer's half of two angle tables laid side by side on the last axis."""
    if emb is None:
        return None
    if isinstance(emb, tuple):
        return tuple(_rope_half(e, second) for e in emb)
    half = emb.shape[-1] // 2
    return (emb[..., half:] if second else emb[..., :half]).contiguous()


def _post_norm(module, config, post_norm: bool) -> None:
    from loongforge_hf.kernels.rmsnorm import RMSNorm

    module.post_layernorm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon) if post_norm else None


@functools.cache
def transformed_attention(*, post_norm: bool = False, scale: float = 1.0,
                          sliding_layers: frozenset[int] | None = None, full_qk_scale: float = 1.0) -> type:
    """megatron's ``SelfAttention`` with its output normalised (``post_norm``) and / or multiplied by ``scale``;
    with ``sliding_layers`` (0-based global indices), the layer's half of two side-by-side rotary tables, and the
    other layers' q / k norm outputs multiplied by ``full_qk_scale`` (a rope attention factor, where the rotation
    covers whole heads: before the rotation, as cos and sin scaled)."""
    from megatron.core.transformer.attention import SelfAttention

    class TransformedSelfAttention(SelfAttention):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            _post_norm(self, config, post_norm)
            # NOTE: megatron numbers layers from 1, offset by the pipeline stage
            self.second_rope = sliding_layers is not None and self.layer_number - 1 in sliding_layers
            if full_qk_scale != 1.0 and not self.second_rope:
                _rescale(self.q_layernorm, full_qk_scale)
                _rescale(self.k_layernorm, full_qk_scale)

        def forward(self, *args, **kwargs):
            if sliding_layers is not None:
                kwargs["rotary_pos_emb"] = _rope_half(kwargs.get("rotary_pos_emb"), self.second_rope)
            return _transform(super().forward(*args, **kwargs), self.post_layernorm, scale)

    return TransformedSelfAttention


@functools.cache
def transformed_mlp(*, post_norm: bool = False, scale: float = 1.0, gate_scale: float = 1.0) -> type:
    """The dense spec's ``SwiGLUMLP`` (megatron's ``MLP`` for any other activation) with its output normalised and / or
    multiplied by ``scale``; ``gate_scale``: a gated silu MLP's gate multiplied by it before the activation."""
    import torch.nn.functional as F

    from loongforge_hf.kernels.specs import SwiGLUMLP

    class TransformedMLP(SwiGLUMLP):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            _post_norm(self, config, post_norm)
            if gate_scale != 1.0 and not self.fused_swiglu:
                raise ValueError(f"transformed_mlp(gate_scale={gate_scale}): needs a gated silu MLP without "
                                 "megatron's own activation fusions.")

        def forward(self, hidden_states, *args, **kwargs):
            if gate_scale == 1.0:
                out = super().forward(hidden_states, *args, **kwargs)
            else:
                fc1, bias = self.linear_fc1(hidden_states)
                gate, up = (fc1 if bias is None else fc1 + bias).chunk(2, dim=-1)
                out = self.linear_fc2(up * F.silu(gate * gate_scale))
            return _transform(out, self.post_layernorm, scale)

    return TransformedMLP


@functools.cache
def transformed_moe(*, post_norm: bool = False, scale: float = 1.0) -> type:
    """megatron's ``MoELayer`` with its output (routed and shared experts together) normalised (FlexOlmo, AFMoE)
    and / or multiplied by ``scale`` (Cohere2-MoE's average of the routed and shared experts: 0.5)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class TransformedMoELayer(MoELayer):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            _post_norm(self, config, post_norm)

        def forward(self, *args, **kwargs):
            return _transform(super().forward(*args, **kwargs), self.post_layernorm, scale)

    return TransformedMoELayer


@functools.cache
def _scaled(base: type) -> type:
    class Scaled(base):
        """``base``'s output times ``output_scale`` (a Python float)."""

        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) * self.output_scale

    Scaled.__name__ = f"Scaled{base.__name__}"
    return Scaled


def _rescale(module, factor: float) -> None:
    module.__class__ = _scaled(type(module))
    module.output_scale = float(factor)


@functools.cache
def _scaled_sublayer(base: type) -> type:
    class ScaledSublayer(base):
        """``base``'s ``(output, bias)`` times ``output_scale``: a residual branch scaled before megatron's add."""

        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            return out * self.output_scale, None if bias is None else bias * self.output_scale

    ScaledSublayer.__name__ = f"Scaled{base.__name__}"
    return ScaledSublayer


def scale_sublayer_outputs(chunk, factor: float) -> None:
    """Multiply the attention's and the MLP's (or MoE layer's) output of every layer of ``chunk`` by ``factor`` (the
    MoE spec's modules, which ``transformed_attention`` / ``transformed_mlp`` do not replace: GraniteMoE)."""
    for layer in chunk.decoder.layers:
        for module in (layer.self_attention, layer.mlp):
            module.__class__ = _scaled_sublayer(type(module))
            module.output_scale = float(factor)


def scale_embedding(chunk, factor: float) -> None:
    """Multiply ``chunk``'s embedding output by ``factor`` (first pipeline stage only; elsewhere nothing)."""
    if chunk.pre_process:
        _rescale(chunk.embedding, factor)


def scale_final_norm(chunk, factor: float) -> None:
    """Multiply ``chunk``'s final-norm output, the LM head's input, by ``factor`` (last stage only)."""
    if chunk.post_process:
        _rescale(chunk.decoder.final_layernorm, factor)


@functools.cache
def _scaled_output(base: type) -> type:
    class ScaledOutput(base):
        """megatron's output layer with its logits multiplied by ``logit_scale`` (a Python float)."""

        def forward(self, *args, **kwargs):
            logits, bias = super().forward(*args, **kwargs)
            return logits * self.logit_scale, bias

    return ScaledOutput


def scale_logits(chunk, factor: float) -> None:
    """Multiply ``chunk``'s logits by ``factor`` (last stage only): the output layer's, and the fused training loss's
    (``runtime.fused_loss_sum`` reads ``chunk.logit_scale``)."""
    if chunk.post_process:
        layer = chunk.output_layer
        layer.__class__ = _scaled_output(type(layer))
        layer.logit_scale = chunk.logit_scale = float(factor)


@functools.cache
def _softcapped_output(base: type) -> type:
    class SoftcappedOutput(base):
        """megatron's output layer with its logits soft-capped: ``cap * tanh(logits / cap)`` (``logit_softcap``)."""

        def forward(self, *args, **kwargs):
            logits, bias = super().forward(*args, **kwargs)
            return torch.tanh(logits / self.logit_softcap) * self.logit_softcap, bias

    return SoftcappedOutput


def softcap_logits(chunk, cap: float) -> None:
    """Soft-cap ``chunk``'s logits at ``cap`` (last stage only): the output layer's, and the fused training loss's
    (``runtime.fused_loss_sum`` reads ``chunk.logit_softcap``)."""
    if chunk.post_process:
        layer = chunk.output_layer
        layer.__class__ = _softcapped_output(type(layer))
        layer.logit_softcap = chunk.logit_softcap = float(cap)
