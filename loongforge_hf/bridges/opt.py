"""OPTForCausalLM (Meta's OPT 125M / 1.3B / 2.7B / 6.7B / 13B / 30B / 66B, Galactica and their fine-tunes): GPT-2's
pre-LayerNorm layer with ``nn.Linear`` weights and ReLU, learned positions read two rows down their table.

Choices:
- GPT-2's bridge (``gpt2.py``) for what they share: learned absolute positions (``absolute_positions.py``), LayerNorms
  with weight and bias (``eps`` 1e-5: transformers' ``nn.LayerNorm`` default, the config has none), an ungated MLP
  (``fc1`` / ``fc2``), the LM head tied to the token embedding (``tie_word_embeddings``, on in every hub checkpoint).
- Positions: ``embed_positions`` has ``max_position_embeddings + 2`` rows and position ``p`` reads row ``p + 2``
  (transformers' ``OPTLearnedPositionalEmbedding.offset``): the table whole, with the offset in our
  ``PositionTable`` (``use_position_table(offset=2)``). transformers counts a forward's default positions from each
  row's first real token (``cumsum(attention_mask) * attention_mask - 1``, padding at -1: row 1); so do we where no
  ``position_ids`` are given (``positions_from_mask``: ``absolute_positions.mask_positions``, in the forward, cached
  steps, LoongTrainer's batches and the online trainers' forwards); generate passes its positions.
- ``q_proj`` / ``k_proj`` / ``v_proj`` fuse into ``linear_qkv`` per head, ``out_proj`` is row-parallel; ``enable_bias``
  (on in every hub checkpoint) gives every linear a bias, megatron's ``add_bias_linear`` and ``add_qkv_bias``
  together. transformers scales q before the product; megatron the scores: the same up to rounding.
- ``activation_function``: ``relu`` (``F.relu``, this bridge's: the shared table refuses it for the others) or one of
  the shared table's; ``ffn_dim`` the MLP width.
- Refused, naming the field: ``do_layer_norm_before=False`` (OPT-350m's norms after the residual adds: megatron's
  layer normalises before), ``word_embed_proj_dim`` other than ``hidden_size`` (OPT-350m's ``project_in`` /
  ``project_out``), ``_remove_final_layer_norm``, ``layer_norm_elementwise_affine=False`` and ``layerdrop`` above 0
  (transformers skips whole layers at random in training).
- Dropouts: ``dropout`` on the attention's and the MLP's outputs before the adds (megatron's ``hidden_dropout``),
  ``attention_dropout`` on the probabilities; transformers drops nothing on the embedding output.
- Names: ``model.decoder.{embed_tokens, embed_positions, layers.N.{self_attn.{q,k,v,out}_proj, self_attn_layer_norm,
  fc1, fc2, final_layer_norm}, final_layer_norm}``, ``lm_head.weight`` where untied. The hub's checkpoints store them
  without ``model.`` (``decoder.*``), which transformers adds: read through ``checkpoint_aliases``
  (``base_model_prefix.py``); export writes transformers' names, as ``save_pretrained`` does.
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn.functional as F

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.absolute_positions import use_position_table
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.gpt2 import GPT2Bridge
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel, VocabParallel, biased_mlp_mappings
from loongforge_hf.bridges.registry import register_bridge

D = "decoder.layers.{layer}"
OFFSET = 2  # NOTE: transformers' OPTLearnedPositionalEmbedding.offset
_RENAMED = {"hidden_act": "activation_function", "intermediate_size": "ffn_dim", "initializer_range": "init_std"}


def activation(name: str):
    """OPT's ``activation_function``: ``relu`` (every hub checkpoint's), else the shared table's."""
    return F.relu if name == "relu" else C._act_to_megatron(name)


def activation_name(fn) -> str:
    return "relu" if fn is F.relu else C._act_to_hf(fn)


# NOTE: no eps field (nn.LayerNorm's 1e-5, set in transformer_config_kwargs)
OPT_FIELDS = tuple(replace(f, hf=_RENAMED[f.hf], to_megatron=activation, to_hf=activation_name)
                   if f.hf == "hidden_act" else replace(f, hf=_RENAMED.get(f.hf, f.hf))
                   for f in C.DENSE_FIELDS if f.hf != "rms_norm_eps")


@register_bridge("OPTForCausalLM")
class OPTBridge(GPT2Bridge):
    config_fields = OPT_FIELDS
    token_type_embeddings = False
    embedding_dropout = 0.0
    positions_from_mask = True  # NOTE: absolute_positions.mask_positions
    checkpoint_aliases = ((r"^decoder\.", "model.decoder."),)  # NOTE: the hub's names, without model.
    # NOTE: where the names differ in the bridges built on this one (BioGPT, XGLM): the decoder's, its final norm's
    # and an untied head's; the token embedding's scale (``scale_embedding``) and a fixed sinusoidal position table
    prefix, final_norm, head = "model.decoder", "final_layer_norm", "lm_head.weight"
    dropout_field = "dropout"
    sinusoidal = False

    def __init__(self, hf_config) -> None:
        self.qkv_bias = bool(getattr(hf_config, "enable_bias", True))
        super().__init__(hf_config)

    @property
    def ffn_hidden_size(self) -> int:
        return self.hf_config.ffn_dim

    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        refused = {"do_layer_norm_before": (c.do_layer_norm_before, False, "OPT-350m's norms after the residual adds"),
                   "_remove_final_layer_norm": (c._remove_final_layer_norm, True, "no final norm"),
                   "layer_norm_elementwise_affine": (c.layer_norm_elementwise_affine, False, "norms without weights"),
                   "layerdrop": (c.layerdrop > 0, True, "whole layers skipped at random in training")}
        for field, (value, bad, what) in refused.items():
            if bool(value) == bad:
                raise C.UnsupportedConfigError(f"{field}={getattr(c, field)} is not supported for {arch} ({what}).")
        if c.word_embed_proj_dim != c.hidden_size:
            raise C.UnsupportedConfigError(
                f"word_embed_proj_dim={c.word_embed_proj_dim} is not supported for {arch}: it must equal hidden_size="
                f"{c.hidden_size} (OPT-350m's project_in / project_out around the layers).")
        activation(c.activation_function)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "layernorm_epsilon": 1e-5, "add_bias_linear": self.qkv_bias,
                "add_qkv_bias": self.qkv_bias, "hidden_dropout": C.dropout_of(self.hf_config, self.dropout_field)}

    @property
    def token_scale(self) -> float:
        """transformers' ``embed_scale``: ``sqrt(hidden_size)`` with ``scale_embedding`` (BioGPT's, XGLM's), else 1."""
        return self.hf_config.hidden_size ** 0.5 if getattr(self.hf_config, "scale_embedding", False) else 1.0

    def finish_model(self, model) -> None:
        use_position_table(model, offset=OFFSET, token_scale=self.token_scale, sinusoidal=self.sinusoidal,
                           padding_idx=self.hf_config.pad_token_id)

    # ---- tensors --------------------------------------------------------------------------------------------
    def _biases(self, maps: list[Mapping]) -> list[Mapping]:
        """``maps`` less the linears' biases where ``enable_bias`` is off (the norms keep theirs)."""
        return maps if self.qkv_bias else [m for m in maps if "norm" in m.megatron or not m.megatron.endswith("bias")]

    @property
    def layer(self) -> str:
        return f"{self.prefix}.layers.{{layer}}"

    def attention_mappings(self) -> list[Mapping]:
        L = self.layer
        a = f"{L}.self_attn"
        return self._biases([
            *(Replicated(f"{D}.input_layernorm.{p}", f"{L}.self_attn_layer_norm.{p}") for p in ("weight", "bias")),
            *(QKV(f"{D}.self_attention.linear_qkv.{p}", q=f"{a}.q_proj.{p}", k=f"{a}.k_proj.{p}", v=f"{a}.v_proj.{p}")
              for p in ("weight", "bias")),
            RowParallel(f"{D}.self_attention.linear_proj.weight", f"{a}.out_proj.weight"),
            Replicated(f"{D}.self_attention.linear_proj.bias", f"{a}.out_proj.bias")])

    def dense_mlp_mappings(self) -> list[Mapping]:
        L = self.layer
        return self._biases([
            *(Replicated(f"{D}.pre_mlp_layernorm.{p}", f"{L}.final_layer_norm.{p}") for p in ("weight", "bias")),
            *biased_mlp_mappings(f"{D}.mlp", f"{L}.fc1", f"{L}.fc2")])

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", f"{self.prefix}.embed_tokens.weight")

    def first_stage_mappings(self) -> list[Mapping]:
        if self.sinusoidal:  # NOTE: computed, not stored (transformers' non-persistent buffer)
            return []
        return [Replicated("embedding.position_embeddings.weight", f"{self.prefix}.embed_positions.weight")]

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [Replicated(f"decoder.final_layernorm.{p}", f"{self.prefix}.{self.final_norm}.{p}")
                               for p in ("weight", "bias")]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", self.head))
        return maps

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.ffn_hidden_size, self.layer.format(layer=layer)
        norms = ("self_attn_layer_norm", "final_layer_norm")
        shapes = {f"{p}.{n}.{w}": (h,) for n in norms for w in ("weight", "bias")}
        shapes.update({f"{p}.self_attn.{x}_proj.weight": (h, h) for x in ("q", "k", "v", "out")})
        shapes.update({f"{p}.fc1.weight": (f, h), f"{p}.fc2.weight": (h, f)})
        if self.qkv_bias:
            shapes.update({f"{p}.self_attn.{x}_proj.bias": (h,) for x in ("q", "k", "v", "out")})
            shapes.update({f"{p}.fc1.bias": (f,), f"{p}.fc2.bias": (h,)})
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        m, norm = self.prefix, f"{self.prefix}.{self.final_norm}"
        shapes = {f"{m}.embed_tokens.weight": (v, h), f"{norm}.weight": (h,), f"{norm}.bias": (h,)}
        if not self.sinusoidal:
            shapes[f"{m}.embed_positions.weight"] = (c.max_position_embeddings + OFFSET, h)
        if not self.tied:
            shapes[self.head] = (v, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes
