"""The classic decoders refused by name with what megatron cannot run exactly (``registry.refuse_architectures``).

Choices:
- BLOOM and MPT: ALiBi (a per-head linear bias on the scores by key distance in place of any position embedding).
  megatron's attention has none; an exact one needs a bias module of ours kept right on every path (the fused and
  flash kernels' softmax scale, causal and padding masks, the slopes sliced with the heads over TP, packed rows,
  context-parallel chunks, the KV cache), which is not built. Falcon-RW's ``alibi`` is refused by field alike
  (``falcon.py``). MPT's ``clip_qkv`` and ``no_bias`` would follow OLMo's and GPT-J's bindings.
"""

from __future__ import annotations

from loongforge_hf.bridges.registry import refuse_architectures

ALIBI = ("ALiBi position biases on the attention scores, which megatron's attention does not have (no exact bias "
         "module for the fused / flash paths, TP-sliced slopes and packed rows)")
refuse_architectures(ALIBI, "BloomForCausalLM", "MptForCausalLM")
