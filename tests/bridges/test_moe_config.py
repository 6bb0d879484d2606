"""MoE / MLA bridge declarations without a process group: config translation, what is refused, names, transforms."""

import pytest
import torch

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.fused_mappings import Expert, GatedMLP
from loongforge_hf.bridges.mappings import ShardContext
from loongforge_hf.testing.tiny_models import _config


def bridge(arch, **overrides):
    import transformers

    cfg = _config(arch, **overrides)
    mapping = transformers.AutoModelForCausalLM._model_mapping
    # NOTE: Mistral 4's config is not in AutoModelForCausalLM's mapping (tiny_models._NOT_AUTO)
    cfg.architectures = [mapping[type(cfg)].__name__ if type(cfg) in mapping else "Mistral4ForCausalLM"]
    return get_bridge(cfg)


def test_routing_translation():
    q = bridge("qwen3_moe").transformer_config_kwargs()
    assert (q["moe_router_score_function"], q["moe_router_pre_softmax"]) == ("softmax", False)
    assert q["moe_layer_freq"] == [0, 1, 1, 1] and q["num_moe_experts"] == 4 and q["moe_ffn_hidden_size"] == 32
    assert q["moe_token_dispatcher_type"] == "alltoall" and q["moe_expert_capacity_factor"] is None
    assert bridge("qwen3_moe", norm_topk_prob=False).transformer_config_kwargs()["moe_router_pre_softmax"] is True
    assert bridge("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[]).transformer_config_kwargs()[
        "moe_layer_freq"] == [0, 1, 0, 1]

    v3 = bridge("deepseek_v3").transformer_config_kwargs()
    assert v3["moe_router_score_function"] == "sigmoid" and v3["moe_router_enable_expert_bias"]
    assert (v3["moe_router_num_groups"], v3["moe_router_group_topk"]) == (4, 2)
    assert v3["moe_router_topk_scaling_factor"] == 2.5 and v3["moe_router_dtype"] == "fp32"
    assert v3["moe_shared_expert_intermediate_size"] == 32 and v3["moe_layer_freq"] == [0, 1, 1, 1]
    assert v3["multi_latent_attention"] and (v3["q_lora_rank"], v3["kv_lora_rank"]) == (32, 16)
    assert (v3["qk_head_dim"], v3["qk_pos_emb_head_dim"], v3["v_head_dim"]) == (16, 8, 16)
    # grouping that can never bind is left out
    assert "moe_router_num_groups" not in bridge("deepseek_v3", n_group=1, topk_group=1).transformer_config_kwargs()

    v2 = bridge("deepseek_v2").transformer_config_kwargs()
    assert (v2["moe_router_score_function"], v2["moe_router_pre_softmax"]) == ("softmax", True)
    assert v2["moe_router_topk_scaling_factor"] == 1.5 and "moe_router_num_groups" not in v2
    assert v2["q_lora_rank"] is None and v2["moe_shared_expert_intermediate_size"] == 64

    # NOTE: ERNIE 4.5 MoE routes by biased_routing.route (its expert bias is none of megatron's: softmax scores)
    e = bridge("ernie4_5_moe").transformer_config_kwargs()
    assert e["moe_layer_freq"] == [0, 1, 1, 0] and (e["num_moe_experts"], e["moe_router_topk"]) == (8, 3)
    assert e["moe_shared_expert_intermediate_size"] == 64 and not e["moe_shared_expert_gate"]
    assert e["moe_router_dtype"] == "fp32" and e["rotary_interleaved"] and not e.get("moe_router_enable_expert_bias")
    assert bridge("ernie4_5_moe", moe_layer_interval=2, moe_layer_start_index=0, moe_layer_end_index=-1,
                  moe_num_shared_experts=0).transformer_config_kwargs()["moe_layer_freq"] == [0, 1, 0, 1]
    assert bridge("ernie4_5_moe", moe_num_shared_experts=0).shared_ffn_size() is None

    # NOTE: OLMoE: every layer sparse, Qwen3-MoE's softmax routing; its q / k norms (over all heads) are the spec's
    # modules, not megatron's qk_layernorm
    o = bridge("olmoe").transformer_config_kwargs()
    assert o["moe_layer_freq"] == [1, 1, 1, 1] and (o["num_moe_experts"], o["moe_router_topk"]) == (8, 3)
    assert o["moe_ffn_hidden_size"] == 32 and o["moe_shared_expert_intermediate_size"] is None
    assert (o["moe_router_score_function"], o["moe_router_pre_softmax"]) == ("softmax", True)
    assert not o["qk_layernorm"] and o["moe_router_dtype"] is None
    assert bridge("olmoe", norm_topk_prob=True).transformer_config_kwargs()["moe_router_pre_softmax"] is False
    assert [m.__name__ for m in bridge("olmoe").qk_module()] == ["FullWidthQNorm", "FullWidthKNorm"]

    # NOTE: MiniMax-M2: every layer sparse, sigmoid scores plus a fixed expert bias (no groups, no scaling), the router
    # in the model's dtype; q / k norms over all heads as OLMoE's; rotary_dim 12 of 24 as megatron's rotary_percent
    m = bridge("minimax_m2")
    k = m.transformer_config_kwargs()
    assert k["moe_layer_freq"] == [1, 1, 1, 1] and (k["num_moe_experts"], k["moe_router_topk"]) == (8, 3)
    assert (k["moe_router_score_function"], k["moe_router_enable_expert_bias"]) == ("sigmoid", True)
    assert k["moe_router_bias_update_rate"] == 0.0 and "moe_router_topk_scaling_factor" not in k
    assert k["moe_ffn_hidden_size"] == 32 and k["moe_shared_expert_intermediate_size"] is None
    assert not k["qk_layernorm"] and k["moe_router_dtype"] is None and k["kv_channels"] == 24
    assert m.rope_parameters()["partial_rotary_factor"] == 0.5
    assert [c.__name__ for c in m.qk_module()] == ["FullWidthQNorm", "FullWidthKNorm"]
    assert m.hf_balance_loss and m.hf_router_logits
    # NOTE: transformers keeps its bias in the model's dtype (DeepSeek-V3's: fp32), so it is written in that dtype
    assert [(type(x).__name__, x.hf_dtype) for x in m.moe_mappings() if x.megatron.endswith("expert_bias")] == [
        ("Replicated", None)]


@pytest.mark.parametrize("arch,overrides,field", [
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("deepseek_v3", {"n_group": 4, "topk_group": 1}, "topk_group=1"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}, "topk_group=1"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ("mistral4", {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}, "norm_topk_prob=True is not supported"),
    ("glm4_moe_lite", {"mlp_layer_types": ["dense", "moe", "dense", "sparse"]}, "mlp_layer_types="),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     "rope_type='linear'"),
    ("deepseek_v3", {"n_shared_experts": 0}, "n_shared_experts=0"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("ernie4_5_moe", {"use_bias": True}, "use_bias=True"),
    ("ernie4_5_moe", {"moe_norm_min": None}, "moe_norm_min=None"),
    ("ernie4_5_moe", {"moe_layer_start_index": 4}, "no MoE layer"),
    ("ernie4_5_moe", {"moe_layer_interval": 0}, "moe_layer_interval=0 must be at least 1"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ("olmoe", {"head_dim": 24}, "head_dim=24"),
    ("olmoe", {"num_experts": 0}, "num_experts=0"),
    ("olmoe", {"attention_bias": True}, "attention_bias=True"),
    ("olmoe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                   "original_max_position_embeddings": 32}}, "yarn"),
    ("minimax_m2", {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ("minimax_m2", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("minimax_m2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                        "original_max_position_embeddings": 32}}, "yarn"),
    ("dots1", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("dots1", {"attention_bias": True}, "attention_bias=True"),
    ("dots1", {"n_shared_experts": 0}, "n_shared_experts=0"),
    ("dots1", {"sliding_window": None}, "sliding_window=None with sliding_attention layers"),
    ("hunyuan_v1_moe", {"attention_bias": True}, "attention_bias=True"),
    ("hunyuan_v1_moe", {"moe_topk": [3, 3, 2, 3]}, "moe_topk=[3, 3, 2, 3]"),
    ("hunyuan_v1_moe", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_type='dynamic' without alpha"),
])
def test_refused_configs_name_the_field(arch, overrides, field):
    with pytest.raises(UnsupportedConfigError, match=field.replace("(", r"\(").replace("[", r"\[")):
        bridge(arch, **overrides)


def test_dots1_translation():
    """dots.llm1: Qwen3's per-head q / k norms, DeepSeek-V3's routing without groups (as the hub's), the window on the
    layers transformers marks sliding (from max_window_layers on)."""
    d = bridge("dots1")
    k = d.transformer_config_kwargs()
    assert k["moe_layer_freq"] == [0, 1, 1, 1] and (k["num_moe_experts"], k["moe_router_topk"]) == (8, 3)
    assert (k["moe_router_score_function"], k["moe_router_enable_expert_bias"]) == ("sigmoid", True)
    assert k["moe_router_bias_update_rate"] == 0.0 and k["moe_router_topk_scaling_factor"] == 2.5
    assert "moe_router_num_groups" not in k and k["moe_router_dtype"] == "fp32"
    assert k["moe_ffn_hidden_size"] == 32 and k["moe_shared_expert_intermediate_size"] == 64
    assert k["qk_layernorm"] and k["kv_channels"] == 24 and not k["add_qkv_bias"]
    assert k["window_size"] == (4, 0) and k["window_attn_skip_freq"] == [0, 0, 1, 1]
    assert d.hf_router_logits and not d.hf_balance_loss
    full = bridge("dots1", layer_types=["full_attention"] * 4).transformer_config_kwargs()
    assert "window_size" not in full and "window_attn_skip_freq" not in full
    shapes = d.expected_hf_shapes()
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (96, 64)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (24,)
    assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)
    assert shapes["model.layers.3.mlp.shared_experts.down_proj.weight"] == (64, 64)


def test_hunyuan_translation():
    """HunYuan-MoE: every layer sparse, softmax top-k renormalised, a shared MLP of intermediate_size, the fixed
    NTK-alpha base, the q / k norm slots rotating first (their HF names query_layernorm / key_layernorm)."""
    h = bridge("hunyuan_v1_moe", moe_topk=[3] * 4)
    k = h.transformer_config_kwargs()
    assert k["moe_layer_freq"] == [1, 1, 1, 1] and (k["num_moe_experts"], k["moe_router_topk"]) == (8, 3)
    assert (k["moe_router_score_function"], k["moe_router_pre_softmax"]) == ("softmax", False)
    assert k["moe_ffn_hidden_size"] == 32 and k["moe_shared_expert_intermediate_size"] == 32
    assert k["qk_layernorm"] and k["moe_router_dtype"] == "fp32" and not k["moe_shared_expert_gate"]
    assert h.rope_parameters() == {"rope_type": "default", "rope_theta": 10000.0 * 1000.0 ** (24 / 22)}
    assert h.qk_module().__name__ == "RotateThenNorm" and h.hf_router_logits and not h.hf_balance_loss
    shapes = h.expected_hf_shapes()
    assert shapes["model.layers.0.self_attn.query_layernorm.weight"] == (24,)
    assert shapes["model.layers.3.mlp.gate.wg.weight"] == (8, 64) and "model.layers.3.mlp.gate.weight" not in shapes
    assert shapes["model.layers.3.mlp.shared_mlp.up_proj.weight"] == (32, 64)


def test_aux_loss_coefficient():
    """transformers' balancing loss is computed by the bridges' own router (router_balance.py): megatron's stays off."""
    from loongforge_hf.bridges.config_map import router_aux_loss_coef_of

    off = bridge("qwen3_moe", router_aux_loss_coef=0.01)
    on = bridge("mixtral", router_aux_loss_coef=0.02, output_router_logits=True)
    assert router_aux_loss_coef_of(off.hf_config) == 0.0 and router_aux_loss_coef_of(on.hf_config) == 0.02
    for b in (off, on):
        kw = b.transformer_config_kwargs()
        assert kw["moe_aux_loss_coeff"] == 0.0 and kw["moe_router_load_balancing_type"] == "none"
        assert b.hf_balance_loss and b.hf_router_logits
    for arch in ("deepseek_v3", "deepseek_v2"):  # transformers returns their router_logits and adds no aux loss
        assert bridge(arch).hf_router_logits and not bridge(arch).hf_balance_loss
    assert bridge("ernie4_5_moe").hf_balance_loss and bridge("ernie4_5_moe").hf_router_logits
    assert bridge("olmoe").hf_balance_loss and bridge("olmoe").hf_router_logits


def test_moe_with_tensor_parallel_needs_sequence_parallel():
    from loongforge_hf.parallel import ParallelConfig, ParallelLayoutError

    sizes = dict(num_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=4)
    with pytest.raises(ParallelLayoutError, match="tensor_parallel_size=2 with a mixture-of-experts model needs "
                                                  "sequence_parallel=True"):
        ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2).check_model(**sizes)
    ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2, sequence_parallel=True).check_model(**sizes)
    ParallelConfig(tensor_parallel_size=2).check_model(**{**sizes, "num_experts": None})


def test_expected_shapes_follow_the_hub_layout():
    shapes = bridge("deepseek_v3").expected_hf_shapes()
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (96, 64)  # dense first layer
    assert shapes["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)
    assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == (32, 64)
    assert shapes["model.layers.3.self_attn.q_b_proj.weight"] == (4 * 24, 32)
    assert not any(".layers.4." in n for n in shapes)
    mixtral = bridge("mixtral").expected_hf_shapes()
    assert mixtral["model.layers.0.block_sparse_moe.experts.3.w3.weight"] == (48, 64)
    assert "model.layers.0.mlp.gate_proj.weight" not in mixtral
    ernie = bridge("ernie4_5_moe").expected_hf_shapes()
    assert ernie["model.layers.1.mlp.moe_statics.e_score_correction_bias"] == (1, 8)  # NOTE: transformers' [1, E]
    assert ernie["model.layers.2.mlp.experts.7.gate_proj.weight"] == (32, 64) and "lm_head.weight" not in ernie
    assert ernie["model.layers.2.mlp.shared_experts.down_proj.weight"] == (64, 64)
    assert ernie["model.layers.3.mlp.gate_proj.weight"] == (96, 64)  # dense last layer (moe_layer_end_index=2)
    olmoe = bridge("olmoe").expected_hf_shapes()  # NOTE: q / k norms over all (kv) heads
    assert olmoe["model.layers.0.self_attn.q_norm.weight"] == (64,)
    assert olmoe["model.layers.0.self_attn.k_norm.weight"] == (32,)
    assert olmoe["model.layers.0.mlp.experts.7.up_proj.weight"] == (32, 64)
    assert olmoe["model.layers.3.mlp.gate.weight"] == (8, 64) and "model.layers.0.mlp.gate_proj.weight" not in olmoe
    m2 = bridge("minimax_m2").expected_hf_shapes()  # NOTE: transformers' save_pretrained names (Mixtral's experts)
    assert m2["model.layers.0.self_attn.q_norm.weight"] == (96,)  # NOTE: heads * head_dim, kv heads * head_dim
    assert m2["model.layers.0.self_attn.k_norm.weight"] == (48,)
    assert m2["model.layers.3.block_sparse_moe.e_score_correction_bias"] == (8,)
    assert m2["model.layers.3.block_sparse_moe.experts.7.w2.weight"] == (64, 32)
    assert m2["model.layers.3.block_sparse_moe.gate.weight"] == (8, 64)


def test_expert_mapping_binds_local_and_global_indices():
    m = Expert(GatedMLP("decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight",
                        gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
                        up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"))
    bound = m.bind(global_expert=5, local_expert=1)
    assert bound.megatron == "decoder.layers.{layer}.mlp.experts.local_experts.1.linear_fc1.weight"
    assert bound.hf_names(3) == ["model.layers.3.mlp.experts.5.gate_proj.weight",
                                 "model.layers.3.mlp.experts.5.up_proj.weight"]
    ctx = ShardContext(tp_rank=1, tp_size=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=10,
                       padded_vocab=256, ep_rank=1, ep_size=2, etp_rank=0, etp_size=1)
    assert (ctx.for_experts().tp_rank, ctx.for_experts().tp_size) == (0, 1)
    with pytest.raises(TypeError):
        m.hf_names(0)


def test_passthrough_names_are_layers_past_the_model():
    names = ["model.layers.3.mlp.gate.weight", "model.layers.4.eh_proj.weight", "model.layers.12.enorm.weight",
             "model.norm.weight"]
    assert bridge("deepseek_v3").passthrough_names(names) == ["model.layers.4.eh_proj.weight",
                                                              "model.layers.12.enorm.weight"]
    assert bridge("qwen3_moe").passthrough_names(names) == []
    ernie = ["model.mtp_block.0.input_layernorm.weight", "model.mtp_linear_proj.0.weight", "model.norm.weight",
             "model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    assert bridge("ernie4_5_moe").passthrough_names(ernie) == ernie[:2]


def test_rope_row_interleave_round_trip():
    w = torch.randn(3 * 10, 5)
    inter = T.interleave_rope_rows(w, block=10, rope_dim=4)
    block = w.reshape(3, 10, 5)
    got = inter.reshape(3, 10, 5)
    assert torch.equal(got[:, :6], block[:, :6])  # non-rotary rows untouched
    assert torch.equal(got[:, 6::2], block[:, 6:8]) and torch.equal(got[:, 7::2], block[:, 8:10])
    assert torch.equal(T.deinterleave_rope_rows(inter, block=10, rope_dim=4), w)
    with pytest.raises(ValueError, match="rope_dim"):
        T.interleave_rope_rows(w, block=10, rope_dim=3)


class _DictReader:
    """A CheckpointReader over a dict of tensors (what the mappings call)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype

    def get(self, name):
        return self.tensors[name].clone()

    def get_slice(self, name, *, dim, start, stop, out=None):
        part = self.tensors[name].narrow(dim, start, stop - start)
        if out is None:
            return part.clone()
        out.copy_(part)
        return out


def test_stacked_expert_mapping_reads_owned_experts_and_exports_one_at_a_time():
    """The grouped expert MLP's stack on EP rank 1 of 2, ETP rank 1 of 2: experts 2 and 3 of 4, each [gate_r; up_r];
    ``bind`` names one expert's HF tensors and its slice of the stack, whose export gives back those tensors."""
    from loongforge_hf.bridges.moe import StackedExpert

    fc1 = StackedExpert(GatedMLP("unused.{expert}", gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
                                 up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"),
                        "decoder.layers.{layer}.mlp.experts.linear_fc1.weight", 4)
    assert fc1.megatron == "decoder.layers.{layer}.mlp.experts.linear_fc1.weight" and fc1.tp_split == "column"
    g = torch.Generator().manual_seed(0)
    hf = {f"model.layers.2.mlp.experts.{e}.{p}.weight": torch.randn(6, 5, generator=g)
          for e in range(4) for p in ("gate_proj", "up_proj")}
    ctx = ShardContext(tp_rank=0, tp_size=1, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=10,
                       padded_vocab=256, ep_rank=1, ep_size=2, etp_rank=1, etp_size=2)
    stack = fc1.load(_DictReader(hf), ctx, 2)
    assert tuple(stack.shape) == (2, 6, 5)
    for local, e in enumerate((2, 3)):
        gate, up = (hf[f"model.layers.2.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(stack[local], torch.cat([gate[3:], up[3:]]))
    one = fc1.bind(global_expert=3, local_expert=1)
    assert one.megatron == fc1.megatron and one.tp_split == "column"
    assert one.hf_names(2) == ["model.layers.2.mlp.experts.3.gate_proj.weight",
                               "model.layers.2.mlp.experts.3.up_proj.weight"]
    other_rank = torch.cat([hf["model.layers.2.mlp.experts.3.gate_proj.weight"][:3],
                            hf["model.layers.2.mlp.experts.3.up_proj.weight"][:3]])
    back = one.export([other_rank, one.local_part(stack)], ctx.for_experts(), 2)
    assert all(torch.equal(back[n], hf[n]) for n in one.hf_names(2))


def test_grouped_experts_switch(monkeypatch):
    from loongforge_hf.bridges.moe import GROUPED_GEMM_ENV, StackedExpert

    monkeypatch.delenv(GROUPED_GEMM_ENV, raising=False)
    grouped = bridge("qwen3_moe")
    assert grouped.grouped_experts
    assert sum(isinstance(m, StackedExpert) for m in grouped.moe_mappings()) == 2
    monkeypatch.setenv(GROUPED_GEMM_ENV, "0")
    sequential = bridge("qwen3_moe")
    assert not sequential.grouped_experts
    routed = [m for m in sequential.moe_mappings() if isinstance(m, Expert)]
    assert len(routed) == 2 and not any(isinstance(m, StackedExpert) for m in routed)
    assert "local_experts.{expert}" in routed[0].megatron
    monkeypatch.setenv(GROUPED_GEMM_ENV, "maybe")
    with pytest.raises(ValueError, match=GROUPED_GEMM_ENV):
        bridge("qwen3_moe")


def test_cuda_graphs_for_moe_checked_before_any_collective(monkeypatch):
    """megatron's local CUDA graphs with MoE layers (``bridges/moe_graphs.check_layout``, pure): allowed for bf16
    grouped experts at expert parallel 1 without router outputs; what cannot be captured is refused by name."""
    from loongforge_hf.bridges import moe_graphs
    from loongforge_hf.bridges.builder import check_megatron_config
    from loongforge_hf.bridges.moe import GROUPED_GEMM_ENV

    from megatron.core.transformer.moe import moe_utils

    monkeypatch.delenv(GROUPED_GEMM_ENV, raising=False)
    monkeypatch.setattr(moe_utils, "fused_permute", None, raising=False)  # NOTE: as without Transformer Engine
    local = {"cuda_graph_impl": "local"}
    moe = bridge("qwen3_moe")

    def check(b=moe, ep=1, dtype=torch.bfloat16, config=local, fp8=None):
        moe_graphs.check_layout(b, b.hf_config, config, expert_parallel_size=ep, dtype=dtype, fp8=fp8)

    check()
    check(dtype=torch.float32, config={})  # NOTE: nothing asked, nothing checked
    check(b=bridge("qwen3"), dtype=torch.float32)  # NOTE: no MoE layers
    for kwargs, reason in (({"ep": 2}, "expert_parallel_size=2: the all-to-all"),
                           ({"dtype": torch.float32}, "dtype=torch.float32: the grouped experts"),
                           ({"b": bridge("qwen3_moe", output_router_logits=True)}, "output_router_logits=True"),
                           ({"fp8": "adaptive"}, "fp8='adaptive': FP8 experts")):
        with pytest.raises(ValueError, match="cuda_graph_impl='local' with MoE layers: " + reason):
            check(**kwargs)
    monkeypatch.setenv(GROUPED_GEMM_ENV, "0")
    with pytest.raises(ValueError, match=f"{GROUPED_GEMM_ENV}=0: megatron's SequentialMLP"):
        check(b=bridge("qwen3_moe"))
    monkeypatch.delenv(GROUPED_GEMM_ENV)
    # NOTE: Transformer Engine importable (its fused permutation in megatron's moe_utils) keeps megatron's dispatcher
    monkeypatch.setattr(moe_utils, "fused_permute", lambda *a, **k: None, raising=False)
    with pytest.raises(ValueError, match="Transformer Engine is installed: its fused permutation"):
        check(b=bridge("qwen3_moe"))
    # NOTE: the CPU backend refuses graphs for every model, MoE or not, with the same reason
    for arch in ("qwen3_moe", "qwen3"):
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device") as refused:
            check_megatron_config(bridge(arch), local)
        assert "MoE" not in str(refused.value)


def _graphed_moe_world(folder: str) -> dict:
    import loongforge_hf as lf
    from loongforge_hf.bridges import moe_graphs
    from loongforge_hf.kernels import grouped_mlp

    # NOTE: as on CUDA, where bf16 expert stacks take torch._grouped_mm (this CPU process has no CUDA tensor)
    grouped_mlp.grouped_mm_supported = lambda x, fc1, fc2, **kw: {x.dtype, fc1.dtype, fc2.dtype} == {torch.bfloat16}
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    out = {"eager": moe_graphs.check_built(model.megatron)}
    model.megatron.config.cuda_graph_impl = "local"  # NOTE: as megatron_config gives it on a GPU
    out["graphed"] = moe_graphs.check_built(model.megatron)
    experts = [m for m in model.chunks[0].modules() if type(m).__name__ == "GroupedMLP"]
    experts[1].forward = experts[1].forward  # NOTE: what an FP8 or adapter swap does
    try:
        moe_graphs.check_built(model.megatron)
    except ValueError as e:
        out["swapped"] = str(e)
    del experts[1].forward
    ids = torch.tensor([[5, 6, 7, 8]])
    out["plain_forward"] = tuple(model(input_ids=ids).logits.shape)
    try:
        model(input_ids=ids, output_router_logits=True)
    except ValueError as e:
        out["router_logits"] = str(e)
    model.config.output_router_logits = True
    try:
        from loongforge_hf.bridges import router_balance

        router_balance.active(model)
    except ValueError as e:
        out["balance"] = str(e)
    return out


def test_cuda_graphs_for_moe_checked_on_the_built_layers(tmp_path):
    """After the build (``moe_graphs.check_built``): every MoE layer must run at fixed shapes without host reads
    (``kernels/moe_permute.fixed_shape_moe``), else a ``ValueError`` names the layers; transformers' router outputs,
    asked for in a forward or switched on in the config later (the trainer's load-balancing loss), are refused under
    the graphs."""
    from loongforge_hf.parallel.spawn import run_distributed
    from loongforge_hf.testing import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer=False)
    got = run_distributed(_graphed_moe_world, 1, str(folder), timeout=180)[0]
    assert got["eager"] is None and got["graphed"] is None, got
    # NOTE: one layer named, the one whose experts' forward was swapped (the second MoE layer)
    assert "do not run at fixed shapes" in got["swapped"] and got["swapped"].count("decoder.layers.") == 1, got
    assert got["plain_forward"][:2] == (1, 4), got
    for key in ("router_logits", "balance"):
        assert "output_router_logits=True" in got[key] and "not with cuda_graph_impl='local'" in got[key], got


def _expert_bias_calls_world(folders: dict) -> dict:
    from megatron.core.transformer.moe.router import TopKRouter

    import loongforge_hf as lf

    calls = []
    compiled = TopKRouter._apply_expert_bias
    TopKRouter._apply_expert_bias = lambda self, *a, **k: calls.append(type(self).__name__) or compiled(self, *a, **k)
    seen = {}
    for arch, folder in folders.items():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ids = torch.randint(3, 50, (1, 8), generator=torch.Generator().manual_seed(0))
        routers = [m for chunk in model.chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        calls.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        seen[arch] = {"routers": len(routers), "calls": len(calls),
                      "bias": [bool(r.enable_expert_bias) for r in routers],
                      "counted": [float(r.local_tokens_per_expert.sum()) if r.enable_expert_bias else None
                                  for r in routers]}
    return seen


def test_expert_bias_update_runs_only_where_there_is_a_bias(tmp_path):
    """The MoE router (``router_balance.BalanceRouter``) calls megatron's torch.compile'd expert-bias update only
    where the router has an expert bias (DeepSeek-V3: it counts each layer's routed tokens), not for Qwen3-MoE (the
    compiled call would do nothing and costs dynamo's guard checks on every layer of every decode step)."""
    from loongforge_hf.parallel.spawn import run_distributed
    from loongforge_hf.testing import make_tiny_checkpoint

    folders = {arch: str(make_tiny_checkpoint(tmp_path / arch, arch)) for arch in ("qwen3_moe", "deepseek_v3")}
    seen = run_distributed(_expert_bias_calls_world, 1, folders, timeout=240)[0]
    qwen, deepseek = seen["qwen3_moe"], seen["deepseek_v3"]
    assert qwen["routers"] > 0 and not any(qwen["bias"]) and qwen["calls"] == 0, qwen
    assert deepseek["routers"] > 0 and all(deepseek["bias"]) and deepseek["calls"] == deepseek["routers"], deepseek
    assert all(c > 0 for c in deepseek["counted"]), deepseek


def test_ernie_refuses_megatron_routing_fields_its_routing_skips():
    from loongforge_hf.bridges.builder import check_megatron_config

    with pytest.raises(ValueError, match="moe_z_loss_coeff: Ernie4_5_MoeForCausalLM routes with its own function"):
        check_megatron_config(bridge("ernie4_5_moe"), {"moe_z_loss_coeff": 1e-3})
    check_megatron_config(bridge("qwen3_moe"), {"moe_z_loss_coeff": 1e-3})  # megatron's own routing applies it


def test_olmoe_q_norm_rounds_as_transformers():
    """In bf16 the q / k norm over all heads rounds as transformers' norm of each model: OLMoE's as Llama's (the
    normalised input rounded, then the weight multiply: ``round_first``), OLMo 2's once at the end; the two differ."""
    from types import SimpleNamespace

    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from loongforge_hf.bridges.olmo2 import full_width_norm

    g = torch.Generator().manual_seed(0)
    cfg = SimpleNamespace(num_attention_heads=4, num_query_groups=2, tensor_model_parallel_size=1,
                          use_cpu_initialization=True, params_dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
    got = {}
    for round_first, ref_cls in ((True, OlmoeRMSNorm), (False, Olmo2RMSNorm)):
        ours, ref = full_width_norm("q", round_first=round_first)(cfg, 16, eps=1e-6), ref_cls(64, eps=1e-6)
        ours.weight.data.copy_(weight)
        ref.weight.data = weight.clone()
        got[round_first] = ours(x.view(3, 5, 4, 16)).reshape(3, 5, 64)
        assert got[round_first].dtype == torch.bfloat16 and torch.equal(got[round_first], ref(x)), round_first
    assert not torch.equal(got[True], got[False])


def test_mla_family_position_and_layout_refusals():
    """Mistral 4's Llama 4 query scale and MiniCPM3's LongRoPE long factors (not built) refuse longer sequences by
    name; MiniCPM3 refuses TP without SP (MLA's rotary-key gradient), both before any collective."""
    from loongforge_hf.parallel.config import ParallelConfig

    mistral = bridge("mistral4")
    mistral.check_sequence_length(32)
    with pytest.raises(ValueError, match="llama_4_scaling_beta=0.1"):
        mistral.check_sequence_length(33)
    minicpm = bridge("minicpm3")
    minicpm.check_sequence_length(128)
    with pytest.raises(ValueError, match="long_factor"):
        minicpm.check_sequence_length(129)
    minicpm.check_layout(ParallelConfig(tensor_parallel_size=2, sequence_parallel=True))
    with pytest.raises(UnsupportedConfigError, match="sequence_parallel=True"):
        minicpm.check_layout(ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(UnsupportedConfigError, match="attention factor"):
        bridge("minicpm3", max_position_embeddings=512)
