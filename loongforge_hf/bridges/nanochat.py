"""NanoChatForCausalLM (Karpathy's nanochat, e.g. nanochat-d32, in transformers' format): Llama's attention with
norms that have no weight, flipped rotary signs, an ungated relu2 MLP and soft-capped logits.

Choices:
- Every norm is ``x * rsqrt(mean(x^2) + eps)`` in fp32, rounded once, without weight: the input, pre-MLP and final
  norms (``norm_weight = False``: ``kernels.rmsnorm.RMSNormWithoutWeight``) and the same norm on the embedding's
  output before the first layer (``finish_model``: the embedding re-classed, first pipeline stage only). No norm
  tensor is read or written.
- q / k: that norm over each head, after the rotation in transformers; here in megatron's q / k norm slots, before
  it: a rotation keeps each head's norm, so the result is the same (fp32 rounding apart), as Llama 4's L2 norm.
- Rotary: transformers' ``rotate_half`` flips its signs (``(x2, -x1)``), which rotates by minus the angle: megatron's
  rotary table with the frequencies negated (cos is even, sin odd). Default or llama3 frequencies; YaRN refused (its
  attention factor on cos / sin is undone by the q / k norms after the rotation, where ours would scale after them).
- MLP: ``fc2(relu2(fc1(x)))`` without a gate (``arcee.PlainMLP`` under NanoChat's names).
- Logits soft-capped at ``final_logit_softcapping`` (``layer_outputs.softcap_logits``: the output layer and the fused
  training loss), as Gemma 2's.
- Refused: ``attention_bias`` (biases on q / k / v and o_proj, where megatron's o_proj bias follows the MLP's).
"""

from __future__ import annotations

import functools

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.arcee import PlainMLP
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.layer_outputs import softcap_logits
from loongforge_hf.bridges.mappings import Mapping, VocabParallel
from loongforge_hf.bridges.registry import register_bridge


@functools.cache
def _normed_embedding(base: type) -> type:
    class NormedEmbedding(base):
        """megatron's embedding with its output normalised by ``output_norm`` (a norm without weight)."""

        def forward(self, *args, **kwargs):
            return self.output_norm(super().forward(*args, **kwargs))

    return NormedEmbedding


def _weighted(maps: list[Mapping]) -> list[Mapping]:
    """``maps`` less the norms' weights (NanoChat's norms have none)."""
    return [m for m in maps if not m.megatron.endswith("layernorm.weight")]


@register_bridge("NanoChatForCausalLM")
class NanoChatBridge(PlainMLP, DenseBridge):
    mlp_names = ("fc1", "fc2")
    norm_weight = False
    extra_rope_types = ()

    def qk_module(self) -> type | None:
        from loongforge_hf.kernels.rmsnorm import RMSNormWithoutWeight

        return RMSNormWithoutWeight

    def finish_model(self, model) -> None:
        from loongforge_hf.kernels.rmsnorm import RMSNormWithoutWeight
        from loongforge_hf.kernels.rope import rope_inv_freq, set_megatron_inv_freq

        c = self.hf_config
        if model.pre_process:
            model.embedding.__class__ = _normed_embedding(type(model.embedding))
            model.embedding.output_norm = RMSNormWithoutWeight(hidden_size=c.hidden_size, eps=c.rms_norm_eps)
        rope = self.rope_parameters()
        set_megatron_inv_freq(model.rotary_pos_emb, -rope_inv_freq(C.head_dim_of(c), base=rope["rope_theta"],
                                                                   rope_scaling=rope))
        if c.final_logit_softcapping is not None:
            softcap_logits(model, c.final_logit_softcapping)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return _weighted(super().attention_mappings())

    def dense_mlp_mappings(self) -> list[Mapping]:
        return _weighted(super().dense_mlp_mappings())

    def final_mappings(self) -> list[Mapping]:
        return [] if self.tied else [VocabParallel("output_layer.weight", "lm_head.weight")]

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v for k, v in super().expected_hf_shapes().items() if not k.endswith("norm.weight")}
