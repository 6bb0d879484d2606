"""Which token's embedding row takes no gradient from lookups (bridges/embedding_padding.py), against transformers' own
model of every supported architecture: its ``get_input_embeddings().padding_idx``, built on the meta device from each
tiny fixture's config (the text config's ``pad_token_id`` set to -1, which ``nn.Embedding`` counts from the end of the
vocabulary), and the row our builder gives megatron's embedding. The gradients themselves are compared with
transformers' in tests/bridges/test_gradients.py (``*_pad`` layouts); a pad id outside the vocabulary is refused in
tests/bridges/test_bad_input.py."""

from __future__ import annotations

import pytest
import torch

from loongforge_hf.testing.tiny_models import TINY_ARCHS

# NOTE: (module under loongforge_hf.testing, config function, keyword arguments) of each image-text fixture
IMAGE_TEXT = {
    "qwen2_5_vl": ("tiny_vl", "tiny_vl_config", {}), "qwen2_vl": ("tiny_vl", "tiny_qwen2_vl_config", {}),
    "qwen3_vl": ("tiny_vl", "tiny_qwen3_vl_config", {}), "qwen3_vl_moe": ("tiny_vl", "tiny_qwen3_vl_moe_config", {}),
    "qwen3_5_vl": ("tiny_vl", "tiny_qwen3_5_vl_config", {}),
    "qwen3_5_moe_vl": ("tiny_vl", "tiny_qwen3_5_moe_vl_config", {}),
    "gemma3_vl": ("tiny_vl", "tiny_gemma3_vl_config", {}), "mistral3": ("tiny_vl", "tiny_mistral3_config", {}),
    "llava": ("tiny_llava", "tiny_llava_config", {}), "llava_next": ("tiny_llava_next", "tiny_llava_next_config", {}),
    "llava_next_video": ("tiny_llava_next_video", "tiny_llava_next_video_config", {}),
    "llava_onevision": ("tiny_llava_onevision", "tiny_llava_onevision_config", {}),
    "smolvlm": ("tiny_idefics3", "tiny_idefics3_config", {}),
    "idefics3": ("tiny_idefics3", "tiny_idefics3_config", {"smolvlm": False}),
    "internvl": ("tiny_internvl", "tiny_internvl_config", {}),
    "llama4_vl": ("tiny_llama4_vl", "tiny_llama4_vl_config", {}),
    "glm4v": ("tiny_glm4v", "tiny_glm4v_config", {}), "glm4v_moe": ("tiny_glm4v", "tiny_glm4v_moe_config", {}),
    "paligemma": ("tiny_paligemma", "tiny_paligemma_config", {}),
    "paligemma2": ("tiny_paligemma", "tiny_paligemma_config", {"gemma2": True}),
    "aya_vision": ("tiny_aya_vision", "tiny_aya_vision_config", {}),
    "gemma4_vl": ("tiny_gemma4_vl", "tiny_gemma4_vl_config", {}),
    "aria_vl": ("tiny_aria_vl", "tiny_aria_vl_config", {}),
}
FIXTURES = (*TINY_ARCHS, *IMAGE_TEXT)


def _padding_rows(name: str) -> dict:
    """transformers' ``padding_idx`` and ours for fixture ``name``, with the architecture transformers built."""
    import importlib

    import transformers

    from loongforge_hf.bridges.embedding_padding import embedding_padding_idx
    from loongforge_hf.bridges.qwen2_5_vl import get_vl_bridge
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.testing.tiny_models import _NOT_AUTO, _config

    if name in IMAGE_TEXT:
        module, fn, kw = IMAGE_TEXT[name]
        config = getattr(importlib.import_module(f"loongforge_hf.testing.{module}"), fn)(**kw)
        auto = transformers.AutoModelForImageTextToText
    else:
        config = _config(name)
        # NOTE: a causal LM AutoModelForCausalLM does not map (Mistral 4): its class builds it
        auto = getattr(transformers, _NOT_AUTO[name]) if name in _NOT_AUTO else transformers.AutoModelForCausalLM
    config.get_text_config().pad_token_id = -1
    with torch.device("meta"):
        model = auto._from_config(config) if name in _NOT_AUTO else auto.from_config(config)
    config.architectures = config.architectures or [type(model).__name__]
    bridge = get_vl_bridge(config) if name in IMAGE_TEXT else get_bridge(config)
    return {"transformers": model.get_input_embeddings().padding_idx, "model": type(model).__name__,
            "ours": embedding_padding_idx(getattr(bridge, "text", bridge)), "bridge": bridge.architectures,
            "vocab_size": config.get_text_config().vocab_size}


@pytest.fixture(scope="module")
def rows() -> dict:
    return {name: _padding_rows(name) for name in FIXTURES}


@pytest.mark.parametrize("name", FIXTURES)
def test_padding_row_is_transformers(rows, name):
    row = rows[name]
    assert row["ours"] == row["transformers"], row
    assert row["ours"] in (None, row["vocab_size"] - 1), row


def test_every_supported_architecture_is_checked(rows):
    from loongforge_hf.bridges.qwen2_5_vl import image_text_architectures
    from loongforge_hf.bridges.registry import supported_architectures

    checked = {arch for row in rows.values() for arch in row["bridge"]}
    missing = set(supported_architectures()) - checked | set(image_text_architectures()) - checked
    assert not missing, sorted(missing)
    unpadded = sorted(row["model"] for row in rows.values() if row["transformers"] is None)
    assert unpadded == ["CodeGenForCausalLM", "FalconForCausalLM", "FalconForCausalLM", "FalconMambaForCausalLM",
                        "GPT2LMHeadModel", "GPTBigCodeForCausalLM", "GPTBigCodeForCausalLM", "GPTJForCausalLM",
                        "GPTNeoForCausalLM", "GPTNeoXForCausalLM", "GPTNeoXJapaneseForCausalLM", "Mamba2ForCausalLM",
                        "MambaForCausalLM", "NemotronHForCausalLM"]
