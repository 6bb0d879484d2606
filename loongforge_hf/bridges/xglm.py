"""XGLMForCausalLM (Meta's XGLM 564M / 1.7B / 2.9B / 4.5B / 7.5B): OPT's layer (pre-LayerNorms, biases everywhere)
with GELU, fixed sinusoidal positions two rows down their table and a token embedding scaled by ``sqrt(d_model)``.

Choices:
- OPT's bridge (``opt.py``) under XGLM's names: ``model.{embed_tokens, layers.N.{self_attn.{q,k,v,out}_proj,
  self_attn_layer_norm, fc1, fc2, final_layer_norm}, layer_norm}``, the LM head tied to the token embedding
  (``tie_word_embeddings``; untied: ``lm_head.weight``). The config's ``d_model`` / ``num_layers`` /
  ``attention_heads`` are read through transformers' ``attribute_map`` (``hidden_size`` ...), ``ffn_dim`` the MLP
  width, ``activation_function`` through OPT's table.
- Positions: fairseq's sinusoidal table of ``max_position_embeddings + 2`` rows, position ``p`` reading row ``p + 2``
  and the ``pad_token_id`` row zero, as transformers' ``XGLMSinusoidalPositionalEmbedding`` builds it: a buffer it
  does not save, computed here the same way (``absolute_positions.sinusoidal_table``; nothing loaded or exported, no
  gradient). transformers counts positions by slot (``past ..``): ``positions_from_mask`` off. transformers grows
  its table past ``max_position_embeddings``; a longer input is refused here (``check_positions``).
- ``scale_embedding``: the token embedding's output times ``sqrt(d_model)`` before the positions are added.
- Dropouts: ``dropout`` on the embedding output and on the attention's and MLP's outputs, ``attention_dropout`` on
  the probabilities. Refused, naming the field: ``activation_dropout`` and ``layerdrop`` above 0 (``biogpt.
  check_dropouts``), ``add_cross_attention`` (an encoder-decoder's cross-attention layers).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.biogpt import check_dropouts
from loongforge_hf.bridges.opt import OPTBridge, activation
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("XGLMForCausalLM")
class XGLMBridge(OPTBridge):
    positions_from_mask = False
    checkpoint_aliases = ()
    prefix, final_norm, head = "model", "layer_norm", "lm_head.weight"
    sinusoidal = True

    @property
    def embedding_dropout(self) -> float:
        return C.dropout_of(self.hf_config, "dropout")

    def check_config(self) -> None:
        check_dropouts(self)
        if getattr(self.hf_config, "add_cross_attention", False):
            raise C.UnsupportedConfigError(f"add_cross_attention=True is not supported for {self.architectures[0]} "
                                           "(cross-attention layers of an encoder-decoder).")
        activation(self.hf_config.activation_function)
