"""Qwen2ForCausalLM (Qwen2, Qwen2.5): bias on q, k and v projections; SeedOssForCausalLM (Seed-OSS): the same with
``head_dim`` of its own and ``residual_dropout`` (megatron's ``hidden_dropout``: both drop the attention and MLP
outputs before the residual adds; transformers drops nothing from the embedding output, nor does megatron's embedding
here: ``DenseBridge.embedding_dropout``, 0)."""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Qwen2ForCausalLM")
class Qwen2Bridge(DenseBridge):
    qkv_bias = True


@register_bridge("SeedOssForCausalLM")
class SeedOssBridge(Qwen2Bridge):

    def check_config(self) -> None:
        super().check_config()
        if getattr(self.hf_config, "attention_out_bias", False):
            raise C.UnsupportedConfigError("attention_out_bias=True (a bias on o_proj) is not supported.")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(),
                "hidden_dropout": C.dropout_of(self.hf_config, "residual_dropout")}
