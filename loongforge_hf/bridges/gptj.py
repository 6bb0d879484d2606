"""GPTJForCausalLM (EleutherAI's GPT-J-6B and its fine-tunes): the attention and the MLP side by side after one
LayerNorm, biases on the MLP and the LM head but not on the attention, the first channels of each head rotated in
interleaved pairs.

Choices:
- One LayerNorm (``ln_1``, weight and bias, ``layer_norm_epsilon``) feeds both sublayers: ``x + attn(ln(x)) +
  mlp(ln(x))``, the spec's ``SharedNormParallelLayer`` (``kernels/specs.py``), as Phi's. ``ln_f`` is the final norm.
- ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj`` have no biases, ``fc_in`` / ``fc_out`` have theirs: megatron
  gives its output projection and the MLP's linears a bias together (``add_bias_linear``, and ``linear_qkv`` one
  with it), so ``add_bias_linear`` stays off and the MLP builds its two linears with biases (``biased_mlp``:
  megatron's local linears, whatever class the spec's slot holds, given ``bias=True``). ``fc_in``'s bias is split
  with its rows over TP, ``fc_out``'s whole on every rank (added after the row-parallel reduction, as StarCoder2's).
- The MLP is ``fc_out(act(fc_in(x)))``: megatron's ungated ``MLP``, ``activation_function`` (``gelu_new``) through the
  shared table; ``n_inner`` is its width (None: ``4 * n_embd``, as transformers).
- Rotary: ``rotary_dim`` (GPT-J-6B: 64 of 256 channels) is megatron's ``rotary_percent`` (``rotary_dim / head_dim``,
  nudged where megatron's ``int`` would round it one short: ``rotary_fraction``) and GPT-J's ``rotate_every_two``
  megatron's ``rotary_interleaved``: both rotate channel pairs ``(2i, 2i + 1)`` of the first ``rotary_dim`` channels
  by frequency ``10000^(-2i / rotary_dim)`` and pass the rest through (GLM-4's combination). An odd ``rotary_dim`` or
  one wider than a head is refused (transformers' forward fails on either; its config refuses None).
- The LM head has a bias (``lm_head.bias``): ``lm_head_bias`` as Phi's (``output_layer.add_output_bias``), in the
  fused training loss too; ``tie_word_embeddings`` (off in GPT-J-6B) shares the weight only;
  ``resize_token_embeddings`` is refused, as Phi's.
- Dropouts: ``resid_pdrop`` drops the attention's and the MLP's outputs before the adds (megatron's
  ``hidden_dropout``), ``embd_pdrop`` the embedding output (the embedding's own dropout, ``embedding_dropout``),
  ``attn_pdrop`` the attention probabilities (megatron's ``attention_dropout``).
- Names: ``transformer.wte``, ``transformer.h.N.{ln_1, attn.{q,k,v,out}_proj, mlp.fc_in, mlp.fc_out}``,
  ``transformer.ln_f``, ``lm_head.{weight, bias}``. Older checkpoints' ``attn.bias`` / ``attn.masked_bias`` buffers
  are not read, as transformers ignores them. transformers' ``token_type_ids`` (added to the embeddings through
  ``wte``) are not taken: the forward refuses them for this architecture (``modeling.py``).
- Shared with other bridges: ``biased_output_attention`` (``linear_proj`` with a bias where ``add_bias_linear`` is off:
  GPT-Neo's ``out_proj``) and ``last_layer_output_bias`` (that bias on the last layer only: GPT-NeoX-Japanese's
  ``dense_bias``), built as ``biased_mlp`` is.
"""

from __future__ import annotations

from dataclasses import replace
import functools
import math

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel, VocabParallel, biased_mlp_mappings
from loongforge_hf.bridges.registry import register_bridge

L = "transformer.h.{layer}"
D = "decoder.layers.{layer}"
_RENAMED = {"rms_norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function",
            "attention_dropout": "attn_pdrop"}
# NOTE: the MLP width (n_inner, None: 4 x n_embd) is set in transformer_config_kwargs
GPTJ_FIELDS = tuple(replace(f, hf=_RENAMED[f.hf], to_megatron=float) if f.hf == "attention_dropout"
                    else replace(f, hf=_RENAMED.get(f.hf, f.hf)) for f in C.DENSE_FIELDS
                    if f.hf != "intermediate_size")


def rotary_fraction(rotary_dim: int, head_dim: int) -> float:
    """The smallest float ``f >= rotary_dim / head_dim`` with ``int(head_dim * f) == rotary_dim`` (megatron's rotary
    width from its ``rotary_percent``): the plain quotient comes out one channel short for some sizes (30 of 44)."""
    fraction = rotary_dim / head_dim
    while int(head_dim * fraction) < rotary_dim:
        fraction = math.nextafter(fraction, 2.0)
    return fraction


@functools.cache
def _built_with_bias(linear: type) -> type:
    """A stand-in for the ``linear`` slot class that builds a plain ``linear`` with ``bias=True`` (its instances are
    ``linear``'s own, which LoRA, ``lean_linear`` and the FP8 swaps recognise by type)."""

    class WithBias:
        def __new__(cls, *args, **kwargs):
            return linear(*args, **{**kwargs, "bias": True})

    WithBias.__name__ = f"{linear.__name__}WithBias"
    return WithBias


@functools.cache
def biased_mlp() -> type:
    """The dense spec's ``SwiGLUMLP`` (megatron's ``MLP`` for an ungated activation) with biases on ``linear_fc1`` /
    ``linear_fc2`` where ``add_bias_linear`` is off (megatron's forward adds them as it adds its own)."""
    from loongforge_hf.kernels.specs import SwiGLUMLP

    class BiasedMLP(SwiGLUMLP):
        def __init__(self, config, submodules, *args, **kwargs) -> None:
            submodules = replace(submodules, linear_fc1=_built_with_bias(submodules.linear_fc1),
                                 linear_fc2=_built_with_bias(submodules.linear_fc2))
            super().__init__(config, submodules, *args, **kwargs)

    return BiasedMLP


@functools.cache
def biased_output_attention() -> type:
    """megatron's ``SelfAttention`` with a bias on ``linear_proj`` where ``add_bias_linear`` is off (GPT-Neo's
    ``out_proj``; its q / k / v have none): whole on every TP rank, added after the row-parallel reduction by the
    layer's bias-dropout-add, as megatron adds its own."""
    from megatron.core.transformer.attention import SelfAttention

    class BiasedOutputAttention(SelfAttention):
        def __init__(self, config, submodules, *args, **kwargs) -> None:
            submodules = replace(submodules, linear_proj=_built_with_bias(submodules.linear_proj))
            super().__init__(config, submodules, *args, **kwargs)

    return BiasedOutputAttention


@functools.cache
def last_layer_output_bias(num_layers: int) -> type:
    """``biased_output_attention`` on the last of ``num_layers`` layers only (GPT-NeoX-Japanese's ``dense_bias``),
    megatron's plain ``SelfAttention`` on the others (``layer_number`` is megatron's global, 1-based)."""
    from megatron.core.transformer.attention import SelfAttention

    class LastLayerOutputBias(SelfAttention):
        def __init__(self, config, submodules, layer_number, *args, **kwargs) -> None:
            if layer_number == num_layers:
                submodules = replace(submodules, linear_proj=_built_with_bias(submodules.linear_proj))
            super().__init__(config, submodules, layer_number, *args, **kwargs)

    return LastLayerOutputBias


@register_bridge("GPTJForCausalLM")
class GPTJBridge(DenseBridge):
    config_fields = GPTJ_FIELDS
    parallel_residual = "shared"
    lm_head_bias = True
    extra_rope_types = ()
    token_type_embeddings = True  # NOTE: transformers adds wte(token_type_ids); refused in the forward

    @property
    def embedding_dropout(self) -> float:
        return C.dropout_of(self.hf_config, "embd_pdrop")

    @property
    def ffn_hidden_size(self) -> int:
        return getattr(self.hf_config, "n_inner", None) or 4 * self.hf_config.hidden_size

    def check_config(self) -> None:
        c = self.hf_config
        hd, rotary = C.head_dim_of(c), getattr(c, "rotary_dim", None)
        if rotary is None or not 0 < rotary <= hd or rotary % 2:
            raise C.UnsupportedConfigError(
                f"rotary_dim={rotary!r} is not supported for {self.architectures[0]}: expected an even number of "
                f"channels in (0, {hd}] (the head size), as transformers' rotary table is rotary_dim / 2 frequencies "
                "wide.")
        C._act_to_megatron(c.activation_function)

    def rope_parameters(self) -> dict:
        return {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": rotary_fraction(self.hf_config.rotary_dim, C.head_dim_of(self.hf_config))}

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm", "gated_linear_unit": False,
                "rotary_interleaved": True, "ffn_hidden_size": self.ffn_hidden_size,
                "hidden_dropout": C.dropout_of(self.hf_config, "resid_pdrop")}

    def mlp_module(self) -> type | None:
        return biased_mlp()

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.attn"
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.ln_1.weight"),
                Replicated(f"{D}.input_layernorm.bias", f"{L}.ln_1.bias"),
                QKV(f"{D}.self_attention.linear_qkv.weight", q=f"{a}.q_proj.weight", k=f"{a}.k_proj.weight",
                    v=f"{a}.v_proj.weight"),
                RowParallel(f"{D}.self_attention.linear_proj.weight", f"{a}.out_proj.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return biased_mlp_mappings(f"{D}.mlp", f"{L}.mlp.fc_in", f"{L}.mlp.fc_out")

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", "transformer.wte.weight")

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [Replicated("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
                               Replicated("decoder.final_layernorm.bias", "transformer.ln_f.bias")]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", "lm_head.weight"))
        return [*maps, VocabParallel("output_layer.bias", "lm_head.bias")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hf_config.hidden_size
        return {f"{prefix}.ln_1.weight": (h,), f"{prefix}.ln_1.bias": (h,),
                **{f"{prefix}.attn.{x}_proj.weight": (h, h) for x in ("q", "k", "v", "out")}}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.ffn_hidden_size, prefix
        return {f"{p}.mlp.fc_in.weight": (f, h), f"{p}.mlp.fc_in.bias": (f,), f"{p}.mlp.fc_out.weight": (h, f),
                f"{p}.mlp.fc_out.bias": (h,)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = L.format(layer=layer)
        return {**self.attention_shapes(prefix), **self.dense_mlp_shapes(prefix)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        shapes = {"transformer.wte.weight": (v, h), "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,),
                  "lm_head.bias": (v,)}
        if not self.tied:
            shapes["lm_head.weight"] = (v, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes
