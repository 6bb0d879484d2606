"""ExaoneForCausalLM (LG's EXAONE 3.0 7.8B and EXAONE 3.5 2.4B / 7.8B / 32B): Llama's layer under GPT-2-style names,
as transformers 5 reads it (``model_type="exaone"`` builds ``LlamaForCausalLM``, renaming the tensors on load and back
on save).

Choices:
- The model is Llama's (``DenseBridge``: GQA, gated silu MLP, RMSNorms, llama3 rope scaling as EXAONE 3.5's); only
  the names differ: ``transformer.wte`` / ``transformer.h.N`` / ``transformer.ln_f``, ``attn.attention.{q,k,v}_proj``
  and ``out_proj``, ``ln_1`` / ``ln_2``, ``mlp.c_fc_0`` (gate) / ``c_fc_1`` (up) / ``c_proj`` (down): the table of
  transformers' ``conversion_mapping`` for ``exaone``, read and written so (``lm_head`` keeps its name; EXAONE 3.5
  2.4B ties it to the embedding).
- A checkpoint transformers 5 saved names its architecture ``LlamaForCausalLM`` with ``model_type="exaone"`` and the
  same tensor names; the registry sends it here by its model type.
- Refused as Llama's: ``attention_bias``, ``mlp_bias``, rope types other than default / llama3 / YaRN.
- LoRA: PEFT matches targets on transformers' module tree (Llama's names: ``q_proj``, ``o_proj``, ``gate_proj``, ...)
  and names the adapter's tensors so; ``checkpoint_name`` takes such a name to this checkpoint's by the same table,
  so the planner finds each target's tensor (``lora/plan.py``).
"""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.mappings import Mapping, replaced, with_replaced_names
from loongforge_hf.bridges.registry import register_bridge, register_model_type

# NOTE: transformers' own table (conversion_mapping.py, "exaone"), Llama's names -> the checkpoint's, in this order
_NAMES = {"model.layers.": "transformer.h.", "model.embed_tokens.": "transformer.wte.",
          "model.norm.": "transformer.ln_f.", ".self_attn.o_proj.": ".attn.attention.out_proj.",
          ".self_attn.": ".attn.attention.", ".input_layernorm.": ".ln_1.", ".post_attention_layernorm.": ".ln_2.",
          ".mlp.gate_proj.": ".mlp.c_fc_0.", ".mlp.up_proj.": ".mlp.c_fc_1.", ".mlp.down_proj.": ".mlp.c_proj."}


@register_model_type("exaone")
@register_bridge("ExaoneForCausalLM")
class ExaoneBridge(DenseBridge):
    def attention_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NAMES) for m in super().attention_mappings()]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NAMES) for m in super().dense_mlp_mappings()]

    def embedding_mapping(self) -> Mapping:
        return with_replaced_names(super().embedding_mapping(), _NAMES)

    def final_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NAMES) for m in super().final_mappings()]

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of transformers' module tree (``model.layers.0.self_attn.o_proj
        .weight`` -> ``transformer.h.0.attn.attention.out_proj.weight``)."""
        return replaced(name, _NAMES)

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {replaced(n, _NAMES): shape for n, shape in super().expected_hf_shapes().items()}
