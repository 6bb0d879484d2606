"""Kernels: one op per file, each a torch function (with its autograd where a fused backward matters) and the module
megatron-core builds from a layer spec. Every op has a torch path that runs on CPU; ``specs`` assembles them.

NOTE: no name exported here equals a submodule's name (``swiglu()`` lives in ``kernels.swiglu``): such a name would
shadow the submodule for ``import loongforge_hf.kernels.<op> as m``."""

from loongforge_hf.kernels.attention import CoreAttention, dot_product_attention, packed_attention, sdpa
from loongforge_hf.kernels.cross_entropy import linear_cross_entropy
from loongforge_hf.kernels.rmsnorm import RMSNorm, rms_norm
from loongforge_hf.kernels.rope import (apply_rotary, llama3_scale_inv_freq, rope_cos_sin, rope_inv_freq, rotate_half,
                                        set_megatron_inv_freq)
from loongforge_hf.kernels.specs import final_norm_spec, get_block_spec, get_layer_spec
from loongforge_hf.kernels.swiglu import SwiGLU

__all__ = ["CoreAttention", "RMSNorm", "SwiGLU", "apply_rotary", "dot_product_attention", "final_norm_spec",
           "get_block_spec", "get_layer_spec", "linear_cross_entropy", "llama3_scale_inv_freq", "packed_attention",
           "rms_norm", "rope_cos_sin", "rope_inv_freq", "rotate_half", "sdpa", "set_megatron_inv_freq"]
