"""``model_flops_per_token`` (MFU's numerator) against the matmul count written out by hand."""

from loongforge_hf.testing.tiny_models import _config
from loongforge_hf.trainer.flops import model_flops_per_token


def test_gated_and_ungated_mlps_counted_by_their_matrices():
    """Llama's gated MLP is three h x f matrices, GPT-NeoX's, StarCoder2's, GPT-J's and GPT-2's (f their n_inner)
    two; attention q / k / v / o, the causal half of the scores and the LM head as written in the function's docstring
    (3x forward)."""
    seq = 32
    for arch, matrices in (("llama", 3), ("gpt_neox", 2), ("starcoder2", 2), ("gptj", 2), ("gpt2", 2)):
        c = _config(arch)
        f = c.n_inner if arch in ("gptj", "gpt2") else c.intermediate_size
        h, heads, layers, v = c.hidden_size, c.num_attention_heads, c.num_hidden_layers, 203
        kv = getattr(c, "num_key_value_heads", None) or heads
        hd = h // heads
        per_layer = 2 * h * (heads + 2 * kv) * hd + 2 * heads * hd * h + 2 * matrices * h * f + 2 * heads * hd * seq
        assert model_flops_per_token(c, seq_len=seq) == 3.0 * (layers * per_layer + 2 * h * v), arch


def test_llama4_dense_moe_and_chunked_layers_counted():
    """Llama 4: dense layers' MLP of intermediate_size_mlp, MoE layers' top-1 expert plus the shared expert, the chunked
    (rotary) layers' scores over at most a chunk of keys, the NoPE layer's over the whole causal half."""
    c = _config("llama4")
    seq, h, hd, heads, kv, v = 32, c.hidden_size, 16, c.num_attention_heads, c.num_key_value_heads, 203
    proj = 2 * h * (heads + 2 * kv) * hd + 2 * heads * hd * h
    dense, moe = 2 * 3 * h * c.intermediate_size_mlp, 2 * 3 * h * 2 * c.intermediate_size
    chunked, full = 2 * heads * hd * 5, 2 * heads * hd * seq  # NOTE: layers 0-2 chunked by 5, layer 3 full
    layers = (proj + dense + chunked) + (proj + moe + chunked) + (proj + dense + chunked) + (proj + moe + full)
    assert model_flops_per_token(c, seq_len=seq) == 3.0 * (layers + 2 * h * v)


def test_falcon_kv_heads_and_mlp_width():
    """Falcon: its MLP two h x f matrices (f its ffn_hidden_size), q / k / v of its KV groups (40B's num_kv_heads) or
    of one KV head (7B's multi_query, whatever num_kv_heads says)."""
    seq = 32
    for arch, kv in (("falcon", 2), ("falcon_mqa", 1)):
        c = _config(arch)
        h, heads, layers, v, f = c.hidden_size, c.num_attention_heads, c.num_hidden_layers, 203, c.ffn_hidden_size
        hd = h // heads
        assert f == 96 and c.num_kv_heads == (2 if arch == "falcon" else heads)
        per_layer = 2 * h * (heads + 2 * kv) * hd + 2 * heads * hd * h + 2 * 2 * h * f + 2 * heads * hd * seq
        assert model_flops_per_token(c, seq_len=seq) == 3.0 * (layers * per_layer + 2 * h * v), arch


def test_gpt_bigcode_kv_heads_and_mlp_width():
    """GPTBigCode: its MLP two h x f matrices (f its n_inner), q / k / v of one KV head with multi_query (StarCoder's),
    of every head without it."""
    seq = 32
    for arch, kv in (("gpt_bigcode", 1), ("gpt_bigcode_mha", 4)):
        c = _config(arch)
        h, heads, layers, v, f = c.hidden_size, c.num_attention_heads, c.num_hidden_layers, 203, c.n_inner
        hd = h // heads
        per_layer = 2 * h * (heads + 2 * kv) * hd + 2 * heads * hd * h + 2 * 2 * h * f + 2 * heads * hd * seq
        assert model_flops_per_token(c, seq_len=seq) == 3.0 * (layers * per_layer + 2 * h * v), arch


def test_qwen3_5_linear_and_gated_full_layers_counted():
    """Qwen3.5: the full-attention layer's q_proj twice as wide (its output gate); each Gated DeltaNet layer's in- /
    out-projections, depthwise conv and three state products per value head and token (no term in the length); the
    gated MLP in every layer."""
    c = _config("qwen3_5")
    seq, h, hd, heads, kv, v, f = 32, c.hidden_size, 16, c.num_attention_heads, c.num_key_value_heads, 203, 96
    full = 2 * h * (2 * heads + 2 * kv) * hd + 2 * heads * hd * h + 2 * heads * hd * seq
    kd, vd, nv = 2 * 8, 4 * 12, 4  # NOTE: 2 key heads of 8, 4 value heads of 12
    linear = 2 * h * (2 * kd + 2 * vd + 2 * nv) + 2 * vd * h + 2 * 4 * (2 * kd + vd) + 3 * 2 * nv * 8 * 12
    mlp = 2 * 3 * h * f
    assert model_flops_per_token(c, seq_len=seq) == 3.0 * (3 * linear + full + 4 * mlp + 2 * h * v)


def test_qwen3_next_and_qwen3_5_moe_experts_and_shared_expert_counted():
    """Qwen3-Next / Qwen3.5-MoE: Qwen3.5's mixers; on MoE layers the top-2 experts of 32 and the shared expert of 48;
    Qwen3-Next's layer 0 is in mlp_only_layers (a dense MLP of 96)."""
    seq, h, v = 32, 64, 203
    full = 2 * h * (2 * 4 + 2 * 2) * 16 + 2 * 4 * 16 * h + 2 * 4 * 16 * seq
    kd, vd, nv = 2 * 8, 4 * 12, 4
    linear = 2 * h * (2 * kd + 2 * vd + 2 * nv) + 2 * vd * h + 2 * 4 * (2 * kd + vd) + 3 * 2 * nv * 8 * 12
    sparse, dense = 2 * 3 * h * (2 * 32 + 48), 2 * 3 * h * 96
    for arch, mlps in (("qwen3_next", dense + 3 * sparse), ("qwen3_5_moe", 4 * sparse)):
        c = _config(arch)
        assert model_flops_per_token(c, seq_len=seq) == 3.0 * (2 * linear + 2 * full + mlps + 2 * h * v), arch
