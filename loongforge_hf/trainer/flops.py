"""Model FLOPs per trained token (forward + backward = 3x forward), for MFU."""

from __future__ import annotations

from loongforge_hf.bridges.config_map import kv_heads_of

# NOTE: model types whose MLP is two matrices (``fc2(act(fc1(x)))``), not gate / up / down
UNGATED_MLP = ("gpt_neox", "starcoder2", "arcee", "phi", "gptj", "falcon", "gpt2", "gpt_bigcode")


def model_flops_per_token(hf_config, *, seq_len: int) -> float:
    """Matmul FLOPs per token of one training step: projections, MLP (active experts), LM head, causal attention."""
    h = hf_config.hidden_size
    if getattr(hf_config, "model_type", None) in ("mamba2", "mamba", "falcon_mamba"):  # NOTE: no attention, no MLP
        mixer = _mamba2_mixer if hf_config.model_type == "mamba2" else _mamba_mixer
        return 3.0 * (hf_config.num_hidden_layers * mixer(hf_config) + 2 * h * hf_config.vocab_size)
    heads = hf_config.num_attention_heads
    kv = kv_heads_of(hf_config)
    hd = getattr(hf_config, "head_dim", None) or h // heads
    layers = hf_config.num_hidden_layers
    # NOTE: the experts' width is moe_intermediate_size where the config has one (Qwen3-MoE), else intermediate_size
    # (Mixtral, gpt-oss: num_local_experts); GPT-J, GPT-2 and GPTBigCode name it n_inner (None: 4 x hidden), Falcon
    # ffn_hidden_size
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    dense = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None) \
        or getattr(hf_config, "ffn_hidden_size", None) or 4 * h
    if isinstance(dense, (list, tuple)):  # NOTE: Gemma 3n's width per layer: their mean, times the layers below
        dense = sum(dense) / len(dense)
    ffn = (getattr(hf_config, "moe_intermediate_size", None) if experts else None) or dense
    active = getattr(hf_config, "num_experts_per_tok", 1) if experts else 1
    attn_proj = 2 * h * (heads * hd + 2 * kv * hd) + 2 * heads * hd * h
    mlp = 2 * (2 if getattr(hf_config, "model_type", None) in UNGATED_MLP else 3) * h * ffn * active
    attn_scores = 2 * 2 * heads * hd * seq_len / 2  # QK^T and AV, causal half
    head = 2 * h * hf_config.vocab_size
    if getattr(hf_config, "model_type", None) == "llama4_text":
        return 3.0 * (layers * attn_proj + _llama4_mlps_and_scores(hf_config, seq_len=seq_len) + head)
    if getattr(hf_config, "model_type", None) in ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"):
        return 3.0 * (_qwen3_5_mixers(hf_config, seq_len=seq_len) + _qwen3_5_mlps(hf_config) + head)
    return 3.0 * (layers * (attn_proj + mlp + attn_scores) + head)


def _mamba2_mixer(hf_config) -> float:
    """A Mamba2 mixer's projections (in_proj: z, x, B, C, dt; out_proj), depthwise conv and SSD scan at its recurrent
    cost (per head and token the state's update and read: two products with the ``head_dim x state_size`` state)."""
    c = hf_config
    inner, bc = c.num_heads * c.head_dim, 2 * c.n_groups * c.state_size
    return (2 * c.hidden_size * (2 * inner + bc + c.num_heads) + 2 * inner * c.hidden_size
            + 2 * c.conv_kernel * (inner + bc) + 2 * 2 * inner * c.state_size)


def _mamba_mixer(hf_config) -> float:
    """A Mamba-1 mixer's projections (in_proj: x, z; x_proj: dt, B, C; dt_proj; out_proj), depthwise conv and
    selective scan (per channel and token the state's update and read: two products with its ``state_size``)."""
    c = hf_config
    d, n, r = c.intermediate_size, c.state_size, int(c.time_step_rank)
    return (2 * c.hidden_size * 2 * d + 2 * d * (r + 2 * n) + 2 * r * d + 2 * d * c.hidden_size
            + 2 * c.conv_kernel * d + 2 * 2 * d * n)


def _llama4_mlps_and_scores(hf_config, *, seq_len: int) -> float:
    """Llama 4's layers past their projections: dense MLPs of ``intermediate_size_mlp``, MoE layers' top-k experts
    plus the shared expert (``intermediate_size`` each), and chunked layers' scores over at most a chunk of keys."""
    c = hf_config
    h, heads, hd = c.hidden_size, c.num_attention_heads, c.head_dim
    moe, kinds = set(c.moe_layers or []), list(c.layer_types or [])
    total = 0.0
    for i in range(c.num_hidden_layers):
        width = (c.num_experts_per_tok + 1) * c.intermediate_size if i in moe else c.intermediate_size_mlp
        keys = min(seq_len, c.attention_chunk_size) if i < len(kinds) and kinds[i] == "chunked_attention" else seq_len
        total += 2 * 3 * h * width + 2 * 2 * heads * hd * keys / 2
    return total


def _qwen3_5_mixers(hf_config, *, seq_len: int) -> float:
    """Qwen3.5's token mixers: full-attention layers with the output gate's rows in q_proj; Gated DeltaNet layers'
    in-projections (q, k, v, z, b, a), depthwise conv and out_proj, and the delta rule at its recurrent cost (per value
    head and token three products with the ``k_dim x v_dim`` state: the read of k, the write, the read of q)."""
    c = hf_config
    h, heads, kv, hd = c.hidden_size, c.num_attention_heads, kv_heads_of(c), c.head_dim
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    nv = c.linear_num_value_heads
    full = 2 * h * (2 * heads * hd + 2 * kv * hd) + 2 * heads * hd * h + 2 * 2 * heads * hd * seq_len / 2
    linear = (2 * h * (2 * kd + 2 * vd + 2 * nv) + 2 * vd * h + 2 * c.linear_conv_kernel_dim * (2 * kd + vd)
              + 3 * 2 * nv * c.linear_key_head_dim * c.linear_value_head_dim)
    return sum(linear if kind == "linear_attention" else full for kind in c.layer_types)


def _qwen3_5_mlps(hf_config) -> float:
    """Qwen3.5's gated MLPs; Qwen3-Next's / Qwen3.5-MoE's: on MoE layers (not in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th) the top-k experts of ``moe_intermediate_size`` plus the shared expert of
    ``shared_expert_intermediate_size``, dense MLPs of ``intermediate_size`` elsewhere (router and the shared
    expert's gate left out, as for the other MoE models)."""
    c = hf_config
    h = c.hidden_size
    dense = 2 * 3 * h * (getattr(c, "intermediate_size", None) or 0)  # NOTE: Qwen3.5-MoE's config has none
    if not getattr(c, "num_experts", None):
        return c.num_hidden_layers * dense
    dense_only, step = set(getattr(c, "mlp_only_layers", None) or []), getattr(c, "decoder_sparse_step", None) or 1
    sparse = 2 * 3 * h * (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size)
    return sum(sparse if i not in dense_only and (i + 1) % step == 0 else dense for i in range(c.num_hidden_layers))
