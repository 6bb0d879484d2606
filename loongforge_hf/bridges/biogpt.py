"""BioGptForCausalLM (Microsoft's BioGPT and BioGPT-Large): OPT's layer (pre-LayerNorms, biases everywhere, learned
positions two rows down their table) with GELU and a token embedding scaled by ``sqrt(hidden_size)``.

Choices:
- OPT's bridge (``opt.py``) under BioGPT's names: ``biogpt.{embed_tokens, embed_positions, layers.N.{self_attn.{q,k,v,
  out}_proj, self_attn_layer_norm, fc1, fc2, final_layer_norm}, layer_norm}``, the LM head ``output_projection``
  tied to the token embedding (``tie_word_embeddings``, every hub checkpoint's).
- Positions: transformers' ``BioGptModel`` passes the slots (``past .. past + s - 1``) to its table where no
  ``position_ids`` are given (its table's own count from the mask is never reached), so ours are the slots' too
  (``positions_from_mask`` off); a position ``p`` reads row ``p + 2`` (``PositionTable``'s offset).
- ``scale_embedding``: the token embedding's output times ``sqrt(hidden_size)`` before the positions are added
  (``absolute_positions.use_position_table(token_scale=)``).
- LayerNorms are transformers' ``nn.LayerNorm`` defaults (eps 1e-5: the config's ``layer_norm_eps`` is not read by
  transformers' model). ``hidden_act`` through the shared table; ``intermediate_size`` the MLP width.
- Dropouts: ``hidden_dropout_prob`` on the embedding output and on the attention's and MLP's outputs,
  ``attention_probs_dropout_prob`` on the probabilities. Refused, naming the field: ``activation_dropout`` above 0
  (a dropout inside the MLP megatron has not), ``layerdrop`` above 0 (whole layers skipped at random).
"""

from __future__ import annotations

from dataclasses import replace

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.opt import OPTBridge
from loongforge_hf.bridges.registry import register_bridge

BIOGPT_FIELDS = tuple(replace(f, hf="attention_probs_dropout_prob", to_megatron=float)
                      if f.hf == "attention_dropout" else f for f in C.DENSE_FIELDS if f.hf != "rms_norm_eps")


def check_dropouts(bridge) -> None:
    """``UnsupportedConfigError`` naming ``activation_dropout`` / ``layerdrop`` above 0 (BioGPT's, XGLM's)."""
    c = bridge.hf_config
    for field, what in (("activation_dropout", "a dropout inside the MLP"),
                        ("layerdrop", "whole layers skipped at random in training")):
        if C.dropout_of(c, field) > 0:
            raise C.UnsupportedConfigError(f"{field}={getattr(c, field)} is not supported for "
                                           f"{bridge.architectures[0]} ({what}).")


@register_bridge("BioGptForCausalLM")
class BioGptBridge(OPTBridge):
    config_fields = BIOGPT_FIELDS
    positions_from_mask = False
    checkpoint_aliases = ()
    prefix, final_norm, head = "biogpt", "layer_norm", "output_projection.weight"
    dropout_field = "hidden_dropout_prob"

    @property
    def embedding_dropout(self) -> float:
        return C.dropout_of(self.hf_config, "hidden_dropout_prob")

    @property
    def ffn_hidden_size(self) -> int:
        return self.hf_config.intermediate_size

    def check_config(self) -> None:
        check_dropouts(self)
        C._act_to_megatron(self.hf_config.hidden_act)
