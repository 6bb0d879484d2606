"""``model_flops_per_token`` (MFU's numerator) against the matmul count written out by hand."""

from loongforge_hf.testing.tiny_models import _config
from loongforge_hf.trainer.flops import model_flops_per_token


def test_gated_and_ungated_mlps_counted_by_their_matrices():
    """Llama's gated MLP is three h x f matrices, GPT-NeoX's, StarCoder2's and GPT-J's (f its n_inner) two; attention
    q / k / v / o, the causal half of the scores and the LM head as written in the function's docstring (3x forward)."""
    seq = 32
    for arch, matrices in (("llama", 3), ("gpt_neox", 2), ("starcoder2", 2), ("gptj", 2)):
        c = _config(arch)
        f = c.n_inner if arch == "gptj" else c.intermediate_size
        h, heads, layers, v = c.hidden_size, c.num_attention_heads, c.num_hidden_layers, 203
        kv = getattr(c, "num_key_value_heads", None) or heads
        hd = h // heads
        per_layer = 2 * h * (heads + 2 * kv) * hd + 2 * heads * hd * h + 2 * matrices * h * f + 2 * heads * hd * seq
        assert model_flops_per_token(c, seq_len=seq) == 3.0 * (layers * per_layer + 2 * h * v), arch
