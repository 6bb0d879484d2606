"""Transformer Engine FP8 recipes (``kernels/fp8_te.py``) on CPU: which layer-spec slots get TE's linears, and the
requests refused before anything is built. Training with them is tested on the GPU (test_gpu_fp8_te.py)."""

import importlib.util

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from loongforge_hf.kernels.fp8 import Fp8Error
from loongforge_hf.kernels.fp8_te import TE_RECIPES, te_config_fields, te_linear_spec
from loongforge_hf.kernels.specs import get_layer_spec

TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


class Column:  # stand-ins for megatron's TE linears: the spec transform only moves classes around
    pass


class Row:
    pass


def _swap(spec):
    return te_linear_spec(spec, column=Column, row=Row)


def test_dense_layer_gets_te_linears_in_the_four_slots_only():
    spec = _swap(get_layer_spec(qk_norm=True))
    sub = spec.submodules
    attn = sub.self_attention.submodules
    assert attn.linear_qkv is Column and attn.linear_proj is Row
    assert sub.mlp.submodules.linear_fc1 is Column and sub.mlp.submodules.linear_fc2 is Row
    original = get_layer_spec(qk_norm=True).submodules
    # norms, core attention and the rest are the local spec's, so parameter names and the bridges' mappings hold
    for name in ("input_layernorm", "pre_mlp_layernorm", "self_attn_bda", "mlp_bda"):
        assert getattr(sub, name) is getattr(original, name)
    for name in ("core_attention", "q_layernorm", "k_layernorm"):
        assert getattr(attn, name) is getattr(original.self_attention.submodules, name)
    assert sub.mlp.module is original.mlp.module


def test_moe_layer_keeps_routed_experts_and_swaps_shared_experts():
    mlp = _swap(get_layer_spec(qk_norm=False, num_experts=4)).submodules.mlp
    experts = mlp.submodules.experts.submodules
    assert experts.linear_fc1 is ColumnParallelLinear and experts.linear_fc2 is RowParallelLinear
    shared = mlp.submodules.shared_experts.submodules
    assert shared.linear_fc1 is Column and shared.linear_fc2 is Row


def test_mla_keeps_its_projections_and_swaps_the_output_projection():
    attn = _swap(get_gpt_layer_local_spec(multi_latent_attention=True)).submodules.self_attention.submodules
    assert attn.linear_proj is Row
    for name in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                 "linear_kv_up_proj"):
        assert getattr(attn, name) is ColumnParallelLinear, name


def test_block_spec_list_is_walked():
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    block = TransformerBlockSubmodules(layer_specs=[get_layer_spec(qk_norm=False)] * 3)
    swapped = _swap(block)
    assert all(s.submodules.self_attention.submodules.linear_qkv is Column for s in swapped.layer_specs)
    assert block.layer_specs[0].submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear  # untouched


def test_config_fields_per_recipe():
    assert te_config_fields("te_delayed") == {"fp8": "hybrid", "fp8_recipe": "delayed"}
    assert te_config_fields("te_tensorwise") == {"fp8": "hybrid", "fp8_recipe": "tensorwise"}
    assert te_config_fields("te_blockwise") == {"fp8": "e4m3", "fp8_recipe": "blockwise"}
    assert te_config_fields("te_mxfp8") == {"fp8": "e4m3", "fp8_recipe": "mxfp8"}
    from megatron.core.enums import Fp8Recipe

    assert {f["fp8_recipe"] for f in map(te_config_fields, TE_RECIPES)} <= {r.value for r in Fp8Recipe}


def test_te_recipe_requests_refused_before_building(tmp_path):
    import loongforge_hf as lf
    from loongforge_hf.kernels.fp8_linear import check_fp8_request
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    with pytest.raises(Fp8Error, match="use it with fp8='on'"):
        check_fp8_request("adaptive", "te_delayed")
    with pytest.raises(Fp8Error, match="te_delayed"):  # the error lists TE's recipes next to ours
        check_fp8_request("on", "delayed")
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    with pytest.raises(ValueError, match="fp8_recipe='te_...'"):
        lf.AutoModelForCausalLM.from_pretrained(folder, megatron_config={"fp8": "hybrid", "fp8_recipe": "delayed"})
    if not TE_INSTALLED:
        with pytest.raises(Fp8Error, match="needs Transformer Engine, which is not installed"):
            lf.AutoModelForCausalLM.from_pretrained(folder, fp8="on", fp8_recipe="te_blockwise")


def test_vision_language_models_refuse_te_recipes(tmp_path):
    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

    folder = make_tiny_qwen2_5_vl(tmp_path / "vl")
    with pytest.raises(Fp8Error, match="offered for text models"):
        lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, fp8="on",
                                                       fp8_recipe="te_blockwise")


def test_engine_switches_te_wgrad_accumulation_only_where_main_grad_exists(monkeypatch):
    """``xpu/common.enable_te_wgrad_accumulation``, with stand-ins for megatron's TE linears: trained weights that DDP
    gave a ``main_grad`` get TE's fused accumulation, frozen ones and other modules are left as they are."""
    from megatron.core.extensions import transformer_engine as te_ext

    from loongforge_hf.xpu import common

    class TEColumn(torch.nn.Module):
        def __init__(self, trained: bool, main_grad: bool):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=trained)
            self.fuse_wgrad_accumulation = False
            if main_grad:
                self.weight.main_grad = torch.zeros(4, 4)

    class TERow(TEColumn):
        pass

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(common.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real_find_spec(name, *a))
    monkeypatch.setattr(te_ext, "TEColumnParallelLinear", TEColumn)
    monkeypatch.setattr(te_ext, "TERowParallelLinear", TERow)
    modules = [TEColumn(True, True), TERow(True, True), TEColumn(False, False), TERow(True, False),
               torch.nn.Linear(4, 4)]
    assert common.enable_te_wgrad_accumulation(iter(modules)) == 2
    assert [getattr(m, "fuse_wgrad_accumulation", None) for m in modules] == [True, True, False, False, None]


@pytest.mark.skipif(TE_INSTALLED, reason="Transformer Engine is installed")
def test_without_te_no_module_is_switched():
    from loongforge_hf.xpu.common import enable_te_wgrad_accumulation

    assert enable_te_wgrad_accumulation([torch.nn.Linear(4, 4)]) == 0
