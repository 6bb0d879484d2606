"""GPTNeoForCausalLM (EleutherAI's GPT-Neo 125M / 1.3B / 2.7B and their fine-tunes): GPT-2's layer with ``nn.Linear``
weights, global and local (sliding-window) attention layers alternating, scores not scaled by ``1 / sqrt(head_dim)``.

Choices:
- GPT-2's bridge (``gpt2.py``) for what they share: learned absolute positions (``wpe``, ``max_position_embeddings``
  rows; ``absolute_positions.py``), pre-LayerNorms with biases (``ln_1``, ``ln_2``, ``ln_f``, ``layer_norm_epsilon``),
  an ungated MLP (``c_fc`` / ``c_proj``, here ``nn.Linear``: no transposition), the LM head tied to ``wte``, and
  ``token_type_ids`` refused in the forward (transformers adds them through ``wte``).
- ``q_proj`` / ``k_proj`` / ``v_proj`` have no bias, ``out_proj`` and the MLP's linears have theirs: megatron's
  ``add_bias_linear`` would give ``linear_qkv`` one too, so it stays off and the attention builds ``linear_proj``
  with a bias (``gptj.biased_output_attention``) and the MLP its two linears (``gptj.biased_mlp``).
- Scores are not scaled (transformers' ``_attn`` has no ``1 / sqrt(head_dim)``): megatron's ``softmax_scale=1``.
- ``attention_layers`` (from ``attention_types``): a ``local`` layer lets a query see itself and the
  ``window_size - 1`` tokens before it, megatron's ``window_size=(window_size - 1, 0)`` on those layers
  (``window_attn_skip_freq`` as a per-layer list, read by our core attention and the KV cache); ``global`` layers see
  every earlier token. Other kinds are refused, as transformers refuses them.
- Dropouts: ``resid_dropout`` on the attention's and the MLP's outputs before the adds (megatron's
  ``hidden_dropout``), ``embed_dropout`` on the embedding output, ``attention_dropout`` on the probabilities.
- transformers computes the scores and softmax in fp32 whatever the model's dtype; our attention's bf16 path keeps
  its own precision (fp32 softmax accumulation, bf16 scores): the same up to bf16 rounding.
- Names: ``transformer.{wte, wpe, h.N.{ln_1, attn.attention.{q,k,v,out}_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f}``,
  ``lm_head.weight`` where untied; the ``attn.attention.bias`` / ``masked_bias`` buffers of older checkpoints are not
  read and are listed as unexpected, as transformers lists them.
"""

from __future__ import annotations

from dataclasses import replace

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.gpt2 import GPT2Bridge
from loongforge_hf.bridges.gptj import biased_mlp, biased_output_attention
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel, biased_mlp_mappings
from loongforge_hf.bridges.registry import register_bridge

L = "transformer.h.{layer}"
D = "decoder.layers.{layer}"
_RENAMED = {"rms_norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function"}
# NOTE: the MLP width (intermediate_size, None: 4 x hidden_size) is set in transformer_config_kwargs
NEO_FIELDS = tuple(replace(f, hf=_RENAMED.get(f.hf, f.hf)) for f in C.DENSE_FIELDS if f.hf != "intermediate_size")
KINDS = ("global", "local")


@register_bridge("GPTNeoForCausalLM")
class GPTNeoBridge(GPT2Bridge):
    config_fields = NEO_FIELDS
    qkv_bias = False

    @property
    def embedding_dropout(self) -> float:
        return C.dropout_of(self.hf_config, "embed_dropout")

    @property
    def ffn_hidden_size(self) -> int:
        return self.hf_config.intermediate_size or 4 * self.hf_config.hidden_size

    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        kinds = list(c.attention_layers)
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown or len(kinds) != c.num_layers:
            raise C.UnsupportedConfigError(f"attention_layers={kinds} is not supported for {arch}: expected one of "
                                           f"{list(KINDS)} for each of its {c.num_layers} layers.")
        if "local" in kinds and not (isinstance(c.window_size, int) and c.window_size > 0):
            raise C.UnsupportedConfigError(f"window_size={c.window_size!r} is not supported for {arch}: local layers "
                                           "need a window of at least one token.")
        C._act_to_megatron(c.activation_function)

    def layer_windows(self) -> dict:
        """megatron's window on the local layers (none where no local layer's window can bind)."""
        c = self.hf_config
        kinds = list(c.attention_layers)
        if "local" not in kinds or c.window_size >= c.max_position_embeddings:
            return {}
        # NOTE: HF lets a query see itself and the window-1 tokens before it; megatron's (left, right) bounds
        return {"window_size": (c.window_size - 1, 0),
                "window_attn_skip_freq": [int(kind == "local") for kind in kinds]}

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "add_bias_linear": False, "add_qkv_bias": False,
                "softmax_scale": 1.0, "hidden_dropout": C.dropout_of(self.hf_config, "resid_dropout"),
                **self.layer_windows()}

    def attention_module(self) -> type | None:
        return biased_output_attention()

    def mlp_module(self) -> type | None:
        return biased_mlp()

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.attn.attention"
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.ln_1.weight"),
                Replicated(f"{D}.input_layernorm.bias", f"{L}.ln_1.bias"),
                QKV(f"{D}.self_attention.linear_qkv.weight", q=f"{a}.q_proj.weight", k=f"{a}.k_proj.weight",
                    v=f"{a}.v_proj.weight"),
                RowParallel(f"{D}.self_attention.linear_proj.weight", f"{a}.out_proj.weight"),
                Replicated(f"{D}.self_attention.linear_proj.bias", f"{a}.out_proj.bias")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.ln_2.weight"),
                Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.ln_2.bias"),
                *biased_mlp_mappings(f"{D}.mlp", f"{L}.mlp.c_fc", f"{L}.mlp.c_proj")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, a = self.hf_config.hidden_size, f"{prefix}.attn.attention"
        return {f"{prefix}.ln_1.weight": (h,), f"{prefix}.ln_1.bias": (h,), f"{a}.out_proj.bias": (h,),
                **{f"{a}.{x}_proj.weight": (h, h) for x in ("q", "k", "v", "out")}}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.ffn_hidden_size, prefix
        return {f"{p}.ln_2.weight": (h,), f"{p}.ln_2.bias": (h,),
                f"{p}.mlp.c_fc.weight": (f, h), f"{p}.mlp.c_fc.bias": (f,),
                f"{p}.mlp.c_proj.weight": (h, f), f"{p}.mlp.c_proj.bias": (h,)}
