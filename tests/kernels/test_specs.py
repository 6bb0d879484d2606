"""A megatron GPTModel built from get_layer_spec runs under TP=2 + sequence parallel, CP=2 and EP=2 (MoE) on CPU ranks,
with the same per-token loss and grads as the same weights without model parallelism; the spec and its TE switch."""

import importlib.util
import math

import pytest
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from loongforge_hf.kernels.attention import CoreAttention
from loongforge_hf.kernels.rmsnorm import RMSNorm
from loongforge_hf.kernels.specs import SwiGLUMLP, final_norm_spec, get_layer_spec
from loongforge_hf.kernels.swiglu import SwiGLU

from ._distributed import GPT_LAYOUTS


@pytest.mark.parametrize("name", list(GPT_LAYOUTS))
def test_gpt_forward_backward_matches_single_rank(name, gpt_layout_results):
    # each rank asserted its per-token loss and every grad at 1e-5 against the unparallelised model
    for rank in gpt_layout_results:
        result = rank[name]
        assert math.isfinite(result["loss"])
        assert result["with_grad"] == result["params"], result


def test_dense_spec_uses_our_modules():
    spec = get_layer_spec(qk_norm=True)
    sub = spec.submodules
    assert sub.input_layernorm is RMSNorm and sub.pre_mlp_layernorm is RMSNorm
    attn = sub.self_attention.submodules
    assert attn.core_attention is CoreAttention and attn.q_layernorm is RMSNorm and attn.k_layernorm is RMSNorm
    assert attn.linear_qkv is ColumnParallelLinear and attn.linear_proj is RowParallelLinear
    assert sub.mlp.module is SwiGLUMLP and issubclass(SwiGLUMLP, MLP) and sub.mlp.submodules.activation_func is SwiGLU
    no_qk = get_layer_spec(qk_norm=False).submodules.self_attention.submodules
    assert no_qk.q_layernorm is IdentityOp and no_qk.k_layernorm is IdentityOp
    assert final_norm_spec() is RMSNorm


def test_moe_spec_and_grouped_gemm_requirement():
    mlp = get_layer_spec(qk_norm=False, num_experts=4).submodules.mlp
    assert mlp.module is MoELayer and mlp.submodules.experts.module is SequentialMLP
    assert mlp.submodules.experts.submodules.linear_fc1 is ColumnParallelLinear
    if importlib.util.find_spec("grouped_gemm") is None:
        with pytest.raises(ImportError, match="grouped_gemm"):
            get_layer_spec(qk_norm=False, num_experts=4, moe_grouped_gemm=True)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed")
def test_use_te_without_transformer_engine_names_the_package():
    with pytest.raises(ImportError, match="transformer_engine"):
        get_layer_spec(qk_norm=True, use_te=True)
    with pytest.raises(ImportError, match="transformer_engine"):
        final_norm_spec(use_te=True)
