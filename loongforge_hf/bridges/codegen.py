"""CodeGenForCausalLM (Salesforce's CodeGen 350M-16B mono / multi / nl, CodeGen 2 / 2.5's 1-style checkpoints and their
fine-tunes): GPT-J's layer with q / v / k fused in one linear in the order of the four model-parallel shards it was
trained with.

Choices:
- GPT-J's bridge (``gptj.py``): one LayerNorm before the attention and the MLP side by side (``x + attn(ln(x)) +
  mlp(ln(x))``), no attention biases, biases on the MLP (``fc_in`` / ``fc_out``) and on the LM head, ``rotary_dim``
  channels of each head rotated in interleaved pairs, GPT-J's config names and dropouts.
- ``qkv_proj`` is ``[4 shards, (q, v, k), heads / 4, head_dim]`` row-wise (transformers' ``mp_num = 4``): each TP
  rank reads its heads' q, k and v rows into megatron's ``linear_qkv`` and writes them back in place on export
  (``packed_mappings.ShardInterleavedQKV``); ``out_proj`` is row-parallel. A head count not divisible by 4 is refused
  (transformers' view of the fused output fails on it).
- ``rotary_dim``: an odd one or one wider than a head is refused as GPT-J's (transformers' forward fails on either;
  its config refuses None, whose sinusoid table would be ``n_embd`` wide).
- Names: ``transformer.wte``, ``transformer.h.N.{ln_1, attn.qkv_proj, attn.out_proj, mlp.fc_in, mlp.fc_out}``,
  ``transformer.ln_f``, ``lm_head.{weight, bias}``; older checkpoints' ``attn.causal_mask`` buffers are not read.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gptj import D, L, GPTJBridge
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.packed_mappings import ShardInterleavedQKV
from loongforge_hf.bridges.registry import register_bridge

MP_NUM = 4  # NOTE: transformers' CodeGenAttention.mp_num


@register_bridge("CodeGenForCausalLM")
class CodeGenBridge(GPTJBridge):
    def check_config(self) -> None:
        heads = self.hf_config.num_attention_heads
        if heads % MP_NUM:
            raise C.UnsupportedConfigError(
                f"n_head={heads} is not supported for CodeGenForCausalLM: qkv_proj is fused in {MP_NUM} shards of "
                "whole heads, so the head count must be a multiple of 4.")
        super().check_config()

    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.attn"
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.ln_1.weight"),
                Replicated(f"{D}.input_layernorm.bias", f"{L}.ln_1.bias"),
                ShardInterleavedQKV(f"{D}.self_attention.linear_qkv.weight", f"{a}.qkv_proj.weight", mp_num=MP_NUM),
                RowParallel(f"{D}.self_attention.linear_proj.weight", f"{a}.out_proj.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hf_config.hidden_size
        return {f"{prefix}.ln_1.weight": (h,), f"{prefix}.ln_1.bias": (h,),
                f"{prefix}.attn.qkv_proj.weight": (3 * h, h), f"{prefix}.attn.out_proj.weight": (h, h)}
