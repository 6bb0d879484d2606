"""Architectures refused by name with what each needs that is not built (the triage modules
``bridges/qwen4_exp_refused.py``, ``dory_zaya_refused.py``, ``xlstm_refused.py``, ``bailing_hybrid_refused.py``):
from the config alone, the message naming every missing piece and listing the supported architectures, and
``lf.AutoModelForCausalLM.from_pretrained`` on a checkpoint folder failing at its config, before a process group or a
weight file is touched."""

import pytest

from loongforge_hf.bridges import UnsupportedArchitectureError, get_bridge


def _qwen4_text():
    import transformers

    return transformers.Qwen4ExpTextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           architectures=["Qwen4ExpForCausalLM"])


def _qwen4():
    import transformers

    return transformers.Qwen4ExpConfig(text_config=_qwen4_text().to_dict(),
                                       architectures=["Qwen4ExpForConditionalGeneration"])


def _small(name: str, arch: str, **kw):
    def make():
        import transformers

        return getattr(transformers, name)(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, architectures=[arch], **kw)
    return make


def _xlstm():
    import transformers

    return transformers.xLSTMConfig(vocab_size=128, hidden_size=64, num_heads=4, num_blocks=2,
                                    architectures=["xLSTMForCausalLM"])


QWEN4 = ("hyper-connection", "hc_count", "QSA indexer", "indexer_compress_ratio", "ple_layer_ids", "split_ngram_parts")
CASES = {  # NOTE: model_type: (config, architecture, a supported architecture the message lists, missing pieces)
    "qwen4_exp_text": (_qwen4_text, "Qwen4ExpForCausalLM", "Qwen3_5MoeForCausalLM", QWEN4),
    "qwen4_exp": (_qwen4, "Qwen4ExpForConditionalGeneration", "Qwen3_5MoeForCausalLM", QWEN4),
    "dory": (_small("DoryConfig", "DoryForCausalLM", num_key_value_heads=2), "DoryForCausalLM", "LagunaForCausalLM",
             ("L2 norms", "lambda_1", "n_recurrent_loops", "recurrent_kv_cache_mode", "sqk", "s_gate", "suv_gate",
              "logit_scale")),
    "zaya": (_small("ZayaConfig", "ZayaForCausalLM", num_key_value_heads=2), "ZayaForCausalLM", "LagunaForCausalLM",
             ("CCA", "cca_time0", "v_proj_delayed", "key temperature", "router_states_scale", "skip expert",
              "residual_scale", "input_hidden_states_scale")),
    "xlstm": (_xlstm, "xLSTMForCausalLM", "Qwen3_5ForCausalLM",
              ("mLSTM", "exponential input gate", "stabiliser", "chunk_size", "gate_soft_cap", "multihead_norm",
               "weight_mode")),
    "bailing_hybrid": (_small("BailingHybridConfig", "BailingHybridForCausalLM", num_key_value_heads=4,
                              num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
                       "BailingHybridForCausalLM", "LaraMiniForCausalLM",
                       ("kda_safe_gate", "kda_lower_bound", "forget_gate.f_proj", "g_a_proj", "self_attn.g_proj",
                        "MLASelfAttention")),
}


@pytest.mark.parametrize("model_type", list(CASES))
def test_refused_by_name_with_what_is_missing(model_type):
    make, arch, supported, missing = CASES[model_type]
    cfg = make()
    assert cfg.model_type == model_type
    with pytest.raises(UnsupportedArchitectureError, match=f"{arch} is not supported: .*{supported}") as e:
        get_bridge(cfg)
    assert all(word in str(e.value) for word in missing), str(e.value)


@pytest.mark.parametrize("model_type", ["qwen4_exp", "zaya", "xlstm", "bailing_hybrid"])
def test_from_pretrained_refused_at_the_config(tmp_path, model_type):
    import torch.distributed as dist

    import loongforge_hf as lf

    make, arch = CASES[model_type][:2]
    make().save_pretrained(tmp_path)
    initialized = dist.is_available() and dist.is_initialized()
    with pytest.raises(UnsupportedArchitectureError, match=f"{arch} is not supported"):
        lf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (dist.is_available() and dist.is_initialized()) == initialized
