"""Qwen4-Exp (text ``Qwen4ExpForCausalLM`` and image-text ``Qwen4ExpForConditionalGeneration``) refused by name
with what it needs that is not built (``bridges/qwen4_exp_refused.py``): from the config alone, before any process
group, as ``lf.AutoModelForCausalLM.from_pretrained`` meets it."""

import pytest

from loongforge_hf.bridges import UnsupportedArchitectureError, get_bridge

MISSING = ("hyper-connection", "hc_count", "QSA indexer", "indexer_compress_ratio", "ple_layer_ids",
           "split_ngram_parts")


def _configs():
    import transformers

    text = transformers.Qwen4ExpTextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           architectures=["Qwen4ExpForCausalLM"])
    image_text = transformers.Qwen4ExpConfig(text_config=text.to_dict(),
                                             architectures=["Qwen4ExpForConditionalGeneration"])
    return {"qwen4_exp_text": text, "qwen4_exp": image_text}


@pytest.mark.parametrize("model_type,arch", [("qwen4_exp_text", "Qwen4ExpForCausalLM"),
                                             ("qwen4_exp", "Qwen4ExpForConditionalGeneration")])
def test_qwen4_exp_refused_by_name(model_type, arch):
    cfg = _configs()[model_type]
    assert cfg.model_type == model_type
    with pytest.raises(UnsupportedArchitectureError, match=f"{arch} is not supported: .*Qwen3_5MoeForCausalLM") as e:
        get_bridge(cfg)
    assert all(word in str(e.value) for word in MISSING), str(e.value)


def test_qwen4_exp_from_pretrained_refused(tmp_path):
    """A checkpoint folder fails at its config, before a process group or a weight file is touched."""
    import torch.distributed as dist

    import loongforge_hf as lf

    _configs()["qwen4_exp"].save_pretrained(tmp_path)
    initialized = dist.is_available() and dist.is_initialized()
    with pytest.raises(UnsupportedArchitectureError, match="Qwen4ExpForConditionalGeneration is not supported"):
        lf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (dist.is_available() and dist.is_initialized()) == initialized
