"""Granite SWA / Granite-MoE SWA, HyperCLOVAX, BitNet and DiffLlama: their settings translated without a world,
DiffLlama's head split refused where TP cannot keep its pairs together, and greedy cached ``generate`` against
transformers at TP2 + SP (one world). Refusals of fields megatron cannot reproduce: test_decoders_2026; parity and
round trips: test_dense_parity / test_moe_parity; gradients: test_gradients."""

import pytest
import torch

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_models import _config

NAMES = {"granite_swa": "GraniteSWAForCausalLM", "granitemoe_swa": "GraniteMoeSWAForCausalLM",
         "hyperclovax": "HyperCLOVAXForCausalLM", "bitnet": "BitNetForCausalLM", "diffllama": "DiffLlamaForCausalLM"}
GENERATE = ("granite_swa", "granitemoe_swa", "hyperclovax", "bitnet", "diffllama")
TOL = 1e-4


def _bridge(arch: str, **overrides):
    return get_bridge(_config(arch, architectures=[NAMES[arch]], **overrides))


def test_settings_translate():
    """Granite SWA: sinks as megatron's learnable softmax offset, the window on the sliding layers, no rotary embedding
    on layer 2 (``layer_rope_theta`` 0), the rotary table at the other layers' base; Granite-MoE SWA: its experts
    under transformers 5's names; HyperCLOVAX: post norms where ``use_post_norm``; BitNet: the sub-norms on the
    row-parallel linears' inputs; DiffLlama: its attention, the lambdas, q / k / v by halves."""
    swa = _bridge("granite_swa", layer_rope_theta=[5e5, 5e5, 0, 5e5])
    kw = swa.transformer_config_kwargs()
    assert kw["softmax_type"] == "learnable" and kw["window_attn_skip_freq"] == [0, 1, 0, 1]
    assert kw["window_size"] == (4, 0) and kw["softmax_scale"] == 0.1 and swa.rope_parameters()["rope_theta"] == 5e5
    assert swa.attention_module().__name__ == "NoRopeSelfAttention"
    assert swa.expected_hf_shapes()["model.layers.0.self_attn.sinks"] == (4,)
    assert _bridge("granite_swa", layer_rope_theta=[1e4] * 4).attention_module().__name__ == "TransformedSelfAttention"
    moe = _bridge("granitemoe_swa").expected_hf_shapes()
    assert moe["model.layers.3.block_sparse_moe.experts.gate_up_proj"] == (4, 96, 64)
    assert {"model.layers.3.block_sparse_moe.router.weight", "model.layers.3.shared_mlp.input_linear.weight"} <= set(
        moe)
    assert "model.layers.1.post_norm2.weight" in _bridge("hyperclovax").expected_hf_shapes()
    assert "model.layers.1.post_norm2.weight" not in _bridge("hyperclovax", use_post_norm=False).expected_hf_shapes()
    bitnet = _bridge("bitnet")
    assert bitnet.attention_module().__name__ == "SubNormedSelfAttention"
    assert bitnet.mlp_module().__name__ == "SubNormedSwiGLUMLP"
    assert bitnet.expected_hf_shapes()["model.layers.0.mlp.ffn_sub_norm.weight"] == (96,)
    diff = _bridge("diffllama")
    assert diff.attention_module().__name__ == "DifferentialSelfAttention"
    assert diff.expected_hf_shapes()["model.layers.2.self_attn.lambda_k2"] == (8,)
    assert type(diff.attention_mappings()[1]).__name__ == "HalvesQKV"


def test_diffllama_heads_split_refused_by_layout():
    """DiffLlama at TP4 with 4 KV heads: each rank would hold one KV head, not a slice of each half: refused by the
    pure layout check naming the field (every rank alike, before any collective); TP2 is served."""
    from loongforge_hf.parallel.config import ParallelConfig

    with pytest.raises(UnsupportedConfigError, match="tensor_parallel_size=4 with num_key_value_heads=4"):
        _bridge("diffllama").check_layout(ParallelConfig(tensor_parallel_size=4))
    _bridge("diffllama").check_layout(ParallelConfig(tensor_parallel_size=2, sequence_parallel=True))


def test_diffllama_lora_on_qkv_planned():
    """q / k / v, which megatron's fused linear holds by halves of the heads (``HalvesQKV``; refused before), plan as
    its slots beside ``o_proj`` and the MLP; their rows' placement: tests/integrations/test_lora.py, PEFT parity:
    tests/integrations/test_lora_new_bridges.py."""
    import peft

    from loongforge_hf.lora.plan import plan_lora

    plan = plan_lora(_bridge("diffllama"), peft.LoraConfig(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    assert sorted({(t.name, t.kind) for t in plan.targets}) == [
        ("down_proj", "row"), ("o_proj", "row"), ("q_proj", "qkv"), ("v_proj", "qkv")]


def _generate(folders: dict) -> dict:
    """Greedy generate of 10 + 6 tokens at TP2 + SP with the dynamic and the static cache against transformers':
    {arch: {cache: (same tokens, largest score difference)}}."""
    import transformers

    import loongforge_hf as lf

    ids = torch.randint(4, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    out = {}
    for arch, folder in folders.items():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                        sequence_parallel=True)
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = ref.generate(input_ids=ids, **kw)
        out[arch] = {}
        for cache in ("dynamic", "static"):
            got = model.generate(input_ids=ids, cache_implementation=cache, **kw)
            out[arch][cache] = (torch.equal(got.sequences, expected.sequences),
                                float(max((a - b).abs().max() for a, b in zip(got.scores, expected.scores))))
    return out


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("generate")
    folders = {arch: str(make_tiny_checkpoint(root / arch, arch, tokenizer=False)) for arch in GENERATE}
    return run_distributed(_generate, 2, folders, timeout=600)


@pytest.mark.parametrize("arch", GENERATE)
def test_cached_generate_matches_transformers(generated, arch):
    """Windows binding past the prompt (Granite SWA), sinks, the doubled values in DiffLlama's cache, BitNet's
    sub-norms: the same tokens as transformers and scores within 1e-4, on both ranks."""
    for rank in generated:
        for cache, (same, diff) in rank[arch].items():
            assert same and diff < TOL, (arch, cache, rank[arch])
