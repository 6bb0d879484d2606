"""Model FLOPs per trained token (forward + backward = 3x forward), for MFU."""

from __future__ import annotations

# NOTE: model types whose MLP is two matrices (``fc2(act(fc1(x)))``), not gate / up / down
UNGATED_MLP = ("gpt_neox", "starcoder2", "arcee", "phi", "gptj")


def model_flops_per_token(hf_config, *, seq_len: int) -> float:
    """Matmul FLOPs per token of one training step: projections, MLP (active experts), LM head, causal attention."""
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    hd = getattr(hf_config, "head_dim", None) or h // heads
    layers = hf_config.num_hidden_layers
    # NOTE: the experts' width is moe_intermediate_size where the config has one (Qwen3-MoE), else intermediate_size
    # (Mixtral, gpt-oss: num_local_experts); GPT-J names it n_inner (None: 4 x hidden)
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    dense = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None) or 4 * h
    ffn = (getattr(hf_config, "moe_intermediate_size", None) if experts else None) or dense
    active = getattr(hf_config, "num_experts_per_tok", 1) if experts else 1
    attn_proj = 2 * h * (heads * hd + 2 * kv * hd) + 2 * heads * hd * h
    mlp = 2 * (2 if getattr(hf_config, "model_type", None) in UNGATED_MLP else 3) * h * ffn * active
    attn_scores = 2 * 2 * heads * hd * seq_len / 2  # QK^T and AV, causal half
    head = 2 * h * hf_config.vocab_size
    return 3.0 * (layers * (attn_proj + mlp + attn_scores) + head)
