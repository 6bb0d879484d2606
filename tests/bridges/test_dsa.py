"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) without a process group: the tiny checkpoints' sparsity matters,
the masked attention is megatron's unfused one where no padding is masked, the indexer's row order is a permutation,
and what cannot be exact is refused by name before any collective. Parity, padding, round trips: test_moe_parity;
gradients: test_gradients."""

import pytest
import torch

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.parallel.config import ParallelConfig
from loongforge_hf.testing.tiny_models import _config

ARCHS = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def bridge(arch, **overrides):
    cfg = _config(arch, **overrides)
    cfg.architectures = [ARCHS[arch]]
    return get_bridge(cfg)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_top_k_changes_the_tiny_models_logits(arch):
    """At the parity tests' 12 tokens the index top-k (4) binds: transformers' logits move with every key kept."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).eval()
    ids = torch.randint(0, 203, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        sparse = model(ids).logits
        for layer in model.model.layers:
            if getattr(layer.self_attn, "indexer", None) is not None:
                layer.self_attn.indexer.index_topk = 12
        dense = model(ids).logits
    assert (sparse - dense).abs().max() > 1e-2


def test_masked_attention_is_megatrons_without_padding():
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    from loongforge_hf.bridges.sparse_attention import masked_sparse_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, 3, d, generator=g) for d in (8, 8, 5))
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1).expand(2, 9, 9)
    topk = torch.rand(2, 9, 9, generator=g).masked_fill(causal, float("-inf")).topk(4, dim=-1).indices  # as indexed
    torch.testing.assert_close(masked_sparse_attention(q, k, v, topk, causal, 0.3), unfused_dsa_fn(q, k, v, topk, 0.3))
    padded = causal.clone()
    padded[0, :, :3] = True  # NOTE: rows 0-2 of batch 0 see no key: finite (transformers' minimum), not NaN
    assert torch.isfinite(masked_sparse_attention(q, k, v, topk, padded, 0.3)).all()


@pytest.mark.parametrize("halves", [True, False])
def test_indexer_rows_round_trip(halves):
    from loongforge_hf.bridges.deepseek_v32 import IndexerRows, indexer_row_order

    order = indexer_row_order(6, 4, halves=halves)
    assert order.tolist() == ([4, 5, 0, 2, 1, 3] if halves else [4, 5, 0, 1, 2, 3])
    rows = IndexerRows("m", "x", head_dim=6, rope_dim=4, halves=halves)
    w = torch.randn(12, 3)

    class Reader:
        def get(self, name):
            return w

    loaded = rows.load(Reader(), None, None)
    assert torch.equal(loaded[6:8], w[10:12]) and torch.equal(rows.export([loaded], None, None)["x"], w)


def test_refusals():
    """Each by name, from the bridge's checks that from_pretrained runs before the process group starts."""
    v32, glm = bridge("deepseek_v32"), bridge("glm_moe_dsa")
    assert v32.shared_layers() == () and glm.shared_layers() == (1, 3)
    # NOTE: DeepSeek-V3.2 refuses no layout (CP runs: test_moe_parity's cp2ep2); GLM-5 PP with shared layers only
    assert not hasattr(v32, "check_layout")
    glm.check_layout(ParallelConfig(context_parallel_size=2))
    glm.check_layout(ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2, sequence_parallel=True))
    with pytest.raises(UnsupportedConfigError, match="pipeline_parallel_size=2 .* shared indexer layers"):
        glm.check_layout(ParallelConfig(pipeline_parallel_size=2))
    bridge("glm_moe_dsa", indexer_types=["full"] * 4).check_layout(ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(UnsupportedConfigError, match="indexer_types="):
        bridge("glm_moe_dsa", indexer_types=["shared", "full", "full", "full"])
    with pytest.raises(UnsupportedConfigError, match="attention_bias=True"):
        bridge("deepseek_v32", attention_bias=True)
    with pytest.raises(UnsupportedConfigError, match="attention_dropout=0.1"):
        bridge("glm_moe_dsa", attention_dropout=0.1)


def test_kv_cache_refusals(monkeypatch):
    """The dynamic KV cache runs for DeepSeek-V3.2, GLM-5 and the bridges built on theirs that it is checked for (HY-V4,
    A.X-K2; generate's tokens: test_moe_parity, test_hy_v4); the static one is refused for each, and any cache for an
    architecture it is not checked for."""
    from loongforge_hf.bridges import deepseek_v32

    config = type("GenerationConfig", (), {"use_cache": True, "cache_implementation": None})()
    hy = _config("hy_v4")
    hy.architectures = ["HYV4ForCausalLM"]
    axk2 = _config("axk2")
    axk2.architectures = ["AXK2ForCausalLM"]
    bridges = [bridge(arch) for arch in ARCHS] + [get_bridge(hy), get_bridge(axk2)]
    for b in bridges:
        assert b.generation_refusal(config) is None
    config.cache_implementation = "static"
    for b in bridges:
        assert f"cache_implementation='static' is not supported for {b.architectures[0]}" in \
            b.generation_refusal(config)
    config.cache_implementation = "dynamic"
    monkeypatch.setattr(deepseek_v32, "KV_CACHE_ARCHITECTURES", ("DeepseekV32ForCausalLM",))
    refusal = bridge("glm_moe_dsa").generation_refusal(config)
    assert "a KV cache is not supported for GlmMoeDsaForCausalLM" in refusal and "use_cache=False" in refusal
    config.use_cache = False
    assert bridge("glm_moe_dsa").generation_refusal(config) is None


def test_cache_layer_keeps_index_keys_with_its_keys():
    """Beam search's reorder, batch repeats and selections, crop and reset move the indexer keys with the keys."""
    from loongforge_hf.bridges.sparse_attention import SparseAttentionCacheLayer

    layer = SparseAttentionCacheLayer()
    keys = torch.arange(3 * 2 * 5 * 4, dtype=torch.float32).view(3, 2, 5, 4)
    index = torch.arange(3 * 5 * 6, dtype=torch.float32).view(3, 5, 6)
    layer.update(keys[:, :, :3], keys[:, :, :3])
    layer.update_index_keys(index[:, :3])
    layer.update(keys[:, :, 3:], keys[:, :, 3:])
    assert torch.equal(layer.update_index_keys(index[:, 3:]), index)
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(layer.keys, keys[[2, 0, 1]]) and torch.equal(layer.index_keys, index[[2, 0, 1]])
    layer.batch_select_indices(torch.tensor([1, 2]))
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.index_keys, index[[0, 0, 1, 1]]) and torch.equal(layer.keys, keys[[0, 0, 1, 1]])
    layer.crop(-2)
    assert layer.keys.shape[2] == layer.index_keys.shape[1] == 3
    layer.reset()
    assert layer.index_keys is None and layer.get_seq_length() == 0
