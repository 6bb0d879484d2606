"""A tiny random GLM-4.1V checkpoint (``Glm4vForConditionalGeneration``) and its processor, written by
``transformers`` itself (no download).

Sizes: a 2-block ViT (hidden 32, 2 heads, q / k / v biases, patch 14, 2x2 merge, a 4x4 learned position grid for
56-pixel images, the post-convolution downsample and the merger into 64 with a gated MLP of width 48); a 4-layer GLM-4
decoder (hidden 64, 2 heads of 32 over 1 KV head, half of each head rotated in interleaved pairs, mrope sections
(2, 3, 3) over those 16 channels). Norm weights, biases and the position grid are random (transformers initialises
norms to 1 and biases to 0, which would hide a dropped tensor).

GLM-4.5V (``make_tiny_glm4v(moe=True)``, ``Glm4vMoeForConditionalGeneration``): the same ViT over a 4-layer GLM-4.5
decoder (layer 0 dense, then 4 routed experts of width 32, top 2 by sigmoid scores with a random correction bias, one
shared expert; rope in rotate-half pairs).

The processor is ``Glm4vProcessor``'s own code over Qwen's tiny word-level tokenizer (``tiny_vl``: its
``<|image_pad|>`` is the image token, so the shared samples of ``tests/multimodal/_vl_parity.py`` serve) and GLM-4.1V's
PIL image processor (images of 28x28 pixels and up); no video processor (transformers' need torchvision: tests
build video batches by hand, ``tests/multimodal/test_glm4v.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_vl import IMAGE_PAD, TEXT_VOCAB, VIDEO_PAD, _randomise, make_vl_tokenizer


def tiny_glm4v_config(**text_overrides):
    from transformers import Glm4vConfig

    text = dict(vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 3, 3]})
    text.update(text_overrides)
    tie = text.pop("tie_word_embeddings", False)
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=text["hidden_size"],
                  patch_size=14, image_size=56, spatial_merge_size=2, temporal_patch_size=2, attention_bias=True,
                  rms_norm_eps=1e-5)
    return Glm4vConfig(text_config=text, vision_config=vision, image_start_token_id=TEXT_VOCAB,
                       image_end_token_id=TEXT_VOCAB + 1, image_token_id=TEXT_VOCAB + 2,
                       video_token_id=TEXT_VOCAB + 3, tie_word_embeddings=tie)


def tiny_glm4v_moe_config(**text_overrides):
    from transformers import Glm4vMoeConfig

    base = tiny_glm4v_config().to_dict()
    text = {**{k: v for k, v in base["text_config"].items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
        "pad_token_id", "rope_parameters")},
        "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, **text_overrides}
    return Glm4vMoeConfig(text_config=text, vision_config=base["vision_config"],
                          **{k: base[k] for k in ("image_start_token_id", "image_end_token_id", "image_token_id",
                                                  "video_token_id")})


def make_glm4v_processor(tokenizer):
    """``Glm4vProcessor`` over ``tokenizer`` (``<|image_pad|>`` its image token; no video markers) and a
    small-image ``Glm4vImageProcessorPil``."""
    from transformers import Glm4vProcessor
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class TinyGlm4vProcessor(Glm4vProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = IMAGE_PAD, VIDEO_PAD
            self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
            self.video_start_id = self.video_end_id = -1  # NOTE: no video markers: every vision token an image's
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    images = Glm4vImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 64}, patch_size=14,
                                    merge_size=2, temporal_patch_size=2)
    return TinyGlm4vProcessor(image_processor=images, tokenizer=tokenizer)


def make_tiny_glm4v(folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB", moe: bool = False,
                    **text_overrides) -> Path:
    """Write a tiny random GLM-4.1V (``moe``: GLM-4.5V) with its tokenizer and image processor; return its folder."""
    from transformers import Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    if moe:
        model = Glm4vMoeForConditionalGeneration(tiny_glm4v_moe_config(**text_overrides))
    else:
        model = Glm4vForConditionalGeneration(tiny_glm4v_config(**text_overrides))
    model = model.to(torch.float32)
    _randomise(model, scaled=("position_embedding", "experts"))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # NOTE: transformers: zeros
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_glm4v_processor(make_vl_tokenizer(folder)).save_pretrained(folder)
    return folder
