"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints and their processors, written by ``transformers`` itself (no
download).

Sizes: ViT depth 2 (block 0 windowed, block 1 full attention), hidden 32, 2 heads, patch 14, 2x2 merge, windows of
2x2 merged tokens (so a 56x84-pixel image spans several); a 4-layer Qwen2 decoder, hidden 64, GQA (4 heads, 2 KV
heads), mrope sections (2, 3, 3); a word-level tokenizer with Qwen's vision special tokens appended. Norm weights and
biases are random (transformers initialises norms to 1 and biases to 0, which would hide a dropped tensor).

Qwen2-VL (``make_tiny_qwen2_vl``): the same decoder under a Qwen2-VL ViT (LayerNorm blocks, quick-GELU ``fc1`` /
``fc2``, ``embed_dim`` 32, the LayerNorm merger into 64), its processor ``Qwen2VLProcessor``'s code.

Qwen3-VL (``make_tiny_qwen3_vl``): ViT depth 3 (patch 16, a 4x4 learned position grid, DeepStack from blocks 0
and 1 into decoder layers 0 and 1), a 4-layer Qwen3 decoder (head_dim 16, q/k norms), interleaved mrope (2, 3, 3).

Qwen3.5 (``make_tiny_qwen3_5_vl``): Qwen3-VL's ViT at depth 2 without DeepStack, a 4-layer Qwen3.5 decoder (Gated
DeltaNet layers 0, 1, 3, a gated full-attention layer 2 with head_dim 64, a quarter of it rotary), interleaved mrope
(2, 3, 3) over the 16 rotary channels; zero-centred text norms stored near 0.
Qwen3.5-MoE (``make_tiny_qwen3_5_moe_vl``): the same with every decoder layer's MLP 4 routed experts (top 2) and a
gated shared expert.

The processor is ``Qwen2_5_VLProcessor``'s (``Qwen3VLProcessor``'s) own code with an image processor and a tokenizer
but no video processor: transformers' video processors need torchvision, which the CPU test environment does not
install.
"""

from __future__ import annotations

from pathlib import Path

import torch

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
TEXT_VOCAB = 200  # "<pad>", "<s>", "</s>", "<unk>", tok4 .. tok199; the four vision tokens follow


def make_vl_tokenizer(folder: str | Path):
    from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

    tok = make_tiny_tokenizer(folder, vocab_size=TEXT_VOCAB)
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    tok.save_pretrained(folder)
    return tok


def image_processor(patch_size: int = 14):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = 2 * patch_size
    return Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=side * side * 64, patch_size=patch_size,
                                    merge_size=2, temporal_patch_size=2)


def make_processor(tokenizer, images=None, *, qwen3: bool = False, base=None):
    """``Qwen2_5_VLProcessor`` (``qwen3``: ``Qwen3VLProcessor`` with 16-pixel patches; ``base``: that processor class,
    e.g. ``Qwen2VLProcessor``) over ``tokenizer`` and a small-image Qwen2-VL image processor (no video processor)."""
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(base or (Qwen3VLProcessor if qwen3 else Qwen2_5_VLProcessor)):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = IMAGE_PAD, VIDEO_PAD
            self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageTextProcessor(image_processor=images or image_processor(16 if qwen3 else 14), tokenizer=tokenizer)


def processor_for(folder: str | Path):
    """The tiny processor of the tiny checkpoint in ``folder`` (its tokenizer; Qwen3-VL's, Qwen2.5-VL's, Qwen2-VL's
    or Gemma 3's, which the folder holds whole)."""
    import json

    from transformers import AutoProcessor, AutoTokenizer, PreTrainedTokenizerFast, Qwen2VLProcessor

    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    if model_type == "gemma3":
        return AutoProcessor.from_pretrained(folder)
    if model_type == "qwen2_vl":
        return make_processor(AutoTokenizer.from_pretrained(folder), base=Qwen2VLProcessor)
    if model_type in ("glm4v", "glm4v_moe"):
        from loongforge_hf.testing.tiny_glm4v import make_glm4v_processor

        return make_glm4v_processor(AutoTokenizer.from_pretrained(folder))
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        # NOTE: AutoTokenizer gives Qwen3.5's checkpoints Qwen3_5Tokenizer (a byte-level BPE) whatever the folder
        # holds: the tiny word-level tokenizer loads as itself
        return make_processor(PreTrainedTokenizerFast.from_pretrained(folder), qwen3=True)
    return make_processor(AutoTokenizer.from_pretrained(folder), qwen3=model_type in ("qwen3_vl", "qwen3_vl_moe"))


def tiny_vl_config(**text_overrides):
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    text.update(text_overrides)
    tie = text.pop("tie_word_embeddings", False)
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=text["hidden_size"], window_size=56,
                  fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, vision_start_token_id=TEXT_VOCAB,
                            vision_end_token_id=TEXT_VOCAB + 1, image_token_id=TEXT_VOCAB + 2,
                            video_token_id=TEXT_VOCAB + 3, tie_word_embeddings=tie)


def make_tiny_qwen2_5_vl(folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB",
                         **text_overrides) -> Path:
    """Write a tiny random Qwen2.5-VL (weights, config, tokenizer, image processor) and return its folder."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_vl_config(**text_overrides)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    tok = make_vl_tokenizer(folder)
    make_processor(tok).save_pretrained(folder)
    return folder


def tiny_qwen2_vl_config(**text_overrides):
    """Qwen2.5-VL's tiny language model under a Qwen2-VL ViT: depth 2, width 32 (``embed_dim``), 2 heads, MLP width
    64 (``mlp_ratio`` 2, quick GELU), patch 14, 2x2 merge into the decoder's 64 (``hidden_size``)."""
    from transformers import Qwen2VLConfig

    text = dict(vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    text.update(text_overrides)
    tie = text.pop("tie_word_embeddings", False)
    vision = dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
    return Qwen2VLConfig(text_config=text, vision_config=vision, vision_start_token_id=TEXT_VOCAB,
                         vision_end_token_id=TEXT_VOCAB + 1, image_token_id=TEXT_VOCAB + 2,
                         video_token_id=TEXT_VOCAB + 3, tie_word_embeddings=tie)


def make_tiny_qwen2_vl(folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB", **text_overrides) -> Path:
    """Write a tiny random Qwen2-VL (weights, config, tokenizer, image processor) and return its folder."""
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(tiny_qwen2_vl_config(**text_overrides)).to(torch.float32)
    _randomise(model, scaled=())
    with torch.no_grad():  # NOTE: the merger's LayerNorm is named ln_q
        for p in model.model.visual.merger.ln_q.parameters():
            p.copy_(p + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_processor(make_vl_tokenizer(folder), base=Qwen2VLProcessor).save_pretrained(folder)
    return folder


def tiny_qwen3_vl_config(**text_overrides):
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    text.update(text_overrides)
    tie = text.pop("tie_word_embeddings", False)
    deepstack = text.pop("deepstack_visual_indexes", [0, 1])
    vision = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=16,
                  deepstack_visual_indexes=deepstack)
    return Qwen3VLConfig(text_config=text, vision_config=vision, vision_start_token_id=TEXT_VOCAB,
                         vision_end_token_id=TEXT_VOCAB + 1, image_token_id=TEXT_VOCAB + 2,
                         video_token_id=TEXT_VOCAB + 3, tie_word_embeddings=tie)


def make_tiny_qwen3_vl(folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB", **text_overrides) -> Path:
    """Write a tiny random Qwen3-VL (weights, config, tokenizer, image processor) and return its folder."""
    from transformers import Qwen3VLForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(**text_overrides)).to(torch.float32)
    _randomise(model, scaled=("pos_embed",))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_processor(make_vl_tokenizer(folder), qwen3=True).save_pretrained(folder)
    return folder


def tiny_qwen3_5_vl_config(**text_overrides):
    from transformers import Qwen3_5Config

    text = dict(vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    text.update(text_overrides)
    tie = text.pop("tie_word_embeddings", False)
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=16)
    return Qwen3_5Config(text_config=text, vision_config=vision, vision_start_token_id=TEXT_VOCAB,
                         vision_end_token_id=TEXT_VOCAB + 1, image_token_id=TEXT_VOCAB + 2,
                         video_token_id=TEXT_VOCAB + 3, tie_word_embeddings=tie)


def make_tiny_qwen3_5_vl(folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB",
                         **text_overrides) -> Path:
    """Write a tiny random Qwen3.5 image-text model (weights, config, tokenizer, image processor), return its folder."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(tiny_qwen3_5_vl_config(**text_overrides)).to(torch.float32)
    return _save_qwen3_5(model, Path(folder), scaled=("pos_embed",), max_shard_size=max_shard_size)


def tiny_qwen3_5_moe_vl_config(**text_overrides):
    """The tiny Qwen3.5 image-text model with Qwen3.5-MoE's decoder: 4 experts of width 32 (2 per token) and a
    gated shared expert of width 48 in every layer."""
    from transformers import Qwen3_5MoeConfig

    base = tiny_qwen3_5_vl_config().to_dict()
    text = {**{k: v for k, v in base["text_config"].items() if k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim", "layer_types", "rope_parameters")},
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        **text_overrides}
    tie = text.pop("tie_word_embeddings", False)
    return Qwen3_5MoeConfig(text_config=text, vision_config=base["vision_config"], vision_start_token_id=TEXT_VOCAB,
                            vision_end_token_id=TEXT_VOCAB + 1, image_token_id=TEXT_VOCAB + 2,
                            video_token_id=TEXT_VOCAB + 3, tie_word_embeddings=tie)


def make_tiny_qwen3_5_moe_vl(folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB",
                             **text_overrides) -> Path:
    """Write a tiny random Qwen3.5-MoE image-text model (routed experts one tensor per expert, as transformers 5
    writes them) and return its folder."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(tiny_qwen3_5_moe_vl_config(**text_overrides)).to(torch.float32)
    return _save_qwen3_5(model, Path(folder), scaled=("pos_embed", "experts."),
                         max_shard_size=max_shard_size)


def _save_qwen3_5(model, folder: Path, *, scaled: tuple[str, ...], max_shard_size: str) -> Path:
    """Randomise a Qwen3.5 image-text model (its zero-centred text norms near 0), save it with its processor."""
    _randomise(model, scaled=scaled)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if "norm" in name and "linear_attn.norm" not in name:  # NOTE: zero-centred: 1 + weight applied
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("linear_attn.dt_bias"):  # NOTE: transformers: ones
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_processor(make_vl_tokenizer(folder), qwen3=True).save_pretrained(folder)
    return folder


@torch.no_grad()
def _randomise(model, *, scaled: tuple[str, ...]) -> None:
    """Norm weights near 1, biases and the parameters named by ``scaled`` random (transformers initialises norms to
    1, biases to 0 and some tables to 0, which would hide a dropped or misplaced tensor)."""
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith(".weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.05 * torch.randn_like(p))
        elif any(s in name for s in scaled):
            p.copy_(0.5 * torch.randn_like(p))


def tiny_qwen3_vl_moe_config(**text_overrides):
    """Qwen3-VL's tiny vision side over a 4-layer Qwen3-MoE decoder: 4 experts of width 48 (2 per token), layer 1
    dense (``mlp_only_layers``)."""
    from transformers import Qwen3VLMoeConfig

    base = tiny_qwen3_vl_config().to_dict()
    text = {**{k: v for k, v in base["text_config"].items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
        "pad_token_id", "rope_parameters")},
        "moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], **text_overrides}
    tie = text.pop("tie_word_embeddings", False)
    return Qwen3VLMoeConfig(text_config=text, vision_config=base["vision_config"],
                            vision_start_token_id=TEXT_VOCAB, vision_end_token_id=TEXT_VOCAB + 1,
                            image_token_id=TEXT_VOCAB + 2, video_token_id=TEXT_VOCAB + 3, tie_word_embeddings=tie)


def make_tiny_qwen3_vl_moe(folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB",
                           hub_expert_layout: bool = False, **text_overrides) -> Path:
    """Write a tiny random Qwen3-VL-MoE and return its folder; ``hub_expert_layout``: the routed experts' stacks
    transposed as the hub's checkpoints hold them (``[E, H, 2I]``, ``[E, I, H]``), not as transformers 5 writes them."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(tiny_qwen3_vl_moe_config(**text_overrides)).to(torch.float32)
    _randomise(model, scaled=("pos_embed", "experts.gate_up_proj", "experts.down_proj"))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if hub_expert_layout:
        for file in folder.glob("*.safetensors"):
            tensors = load_file(file)
            stacked = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
            if stacked:
                tensors.update({k: tensors[k].transpose(1, 2).contiguous() for k in stacked})
                save_file(tensors, str(file), metadata={"format": "pt"})
    make_processor(make_vl_tokenizer(folder), qwen3=True).save_pretrained(folder)
    return folder


# ---- Gemma 3 (image-text) -------------------------------------------------------------------------------------------
GEMMA3_BOI, GEMMA3_EOI, GEMMA3_IMAGE = TEXT_VOCAB, TEXT_VOCAB + 1, TEXT_VOCAB + 2  # ids of its three vision tokens
# (text, vision, projector) prefixes of each on-disk naming (bridges/gemma3_vl.py): what transformers 5 writes, the
# hub's checkpoints, the module names
GEMMA3_NAMINGS = {"transformers": ("language_model.model", "vision_tower", "multi_modal_projector"),
                  "hub": ("language_model.model", "vision_tower.vision_model", "multi_modal_projector"),
                  "modules": ("model.language_model", "model.vision_tower.vision_model", "model.multi_modal_projector")}


def tiny_gemma3_vl_config(**text_overrides):
    """A 4-layer Gemma 3 decoder (sliding layers 0 and 2 with a window of 8, two rotary bases, head_dim 16, GQA)
    under a 2-block SigLIP ViT (56x56 images of 7-pixel patches: 8x8 patches, pooled 2x2 to 16 tokens)."""
    from transformers import Gemma3Config

    text = dict(vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                sliding_window=8, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                pad_token_id=0, layer_types=["sliding_attention", "full_attention"] * 2)
    text.update(text_overrides)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=7, layer_norm_eps=1e-6, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16, boi_token_index=GEMMA3_BOI,
                        eoi_token_index=GEMMA3_EOI, image_token_index=GEMMA3_IMAGE)


def make_tiny_gemma3_vl(folder: str | Path, *, seed: int = 0, naming: str = "transformers",
                        max_shard_size: str = "60KB", **text_overrides) -> Path:
    """Write a tiny random Gemma 3 image-text checkpoint (weights under ``naming``'s prefixes, config, processor) and
    return its folder."""
    from transformers import Gemma3ForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(tiny_gemma3_vl_config(**text_overrides)).to(torch.float32)
    _randomise(model, scaled=("mm_input_projection_weight", "position_embedding"))
    with torch.no_grad():  # NOTE: Gemma's RMSNorms store weight - 1: around 0 (the ViT's LayerNorms around 1)
        for name, p in model.named_parameters():
            if "norm" in name and not name.startswith("model.vision_tower."):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if naming != "transformers":
        rename_prefixes(folder, dict(zip(GEMMA3_NAMINGS["transformers"], GEMMA3_NAMINGS[naming])))
    make_gemma3_processor(folder).save_pretrained(folder)
    return folder


def rename_prefixes(folder: Path, renames: dict[str, str]) -> None:
    """Rewrite the checkpoint in ``folder`` (its shards and index) with each tensor name's prefix ``old`` (a key of
    ``renames``) replaced by ``renames[old]``: another on-disk naming of the same model."""
    import json

    from safetensors.torch import load_file, save_file

    def rename(name: str) -> str:
        old = next(p for p in renames if name == p or name.startswith(p + "."))
        return renames[old] + name[len(old):]

    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    for shard in sorted(folder.glob("*.safetensors")):
        save_file({rename(k): v for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    if index is not None:
        index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
        index_file.write_text(json.dumps(index, indent=2))


def make_gemma3_processor(folder: str | Path):
    """``Gemma3Processor``'s own code over a word-level tokenizer (``tok4`` ..) with Gemma 3's three vision tokens
    (ids 200 - 202, named as the tokenizer's ``boi_token`` / ``eoi_token`` / ``image_token``) and a 56x56 image
    processor; its 16 image tokens per image."""
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

    tok = make_tiny_tokenizer(folder, vocab_size=TEXT_VOCAB)
    tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    tok._set_model_specific_special_tokens(special_tokens=tokens)
    tok.save_pretrained(folder)
    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                           tokenizer=AutoTokenizer.from_pretrained(folder), image_seq_length=16)


def gemma3_image_prompt(rows: list[list[int]], *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(``input_ids [b, s]``, ``token_type_ids``) as Gemma 3's processor lays an image out: ``boi``, 16 image tokens,
    ``eoi``, where a row holds -1; other entries are text ids (every row the same length)."""
    ids = []
    for row in rows:
        ids.append([t for x in row for t in ([GEMMA3_BOI] + [GEMMA3_IMAGE] * 16 + [GEMMA3_EOI] if x == -1 else [x])])
    input_ids = torch.tensor(ids)
    return input_ids, (input_ids == GEMMA3_IMAGE).long()


# ---- Mistral 3 (image-text) -----------------------------------------------------------------------------------------
MISTRAL3_IMG, MISTRAL3_BREAK, MISTRAL3_END = TEXT_VOCAB, TEXT_VOCAB + 1, TEXT_VOCAB + 2  # [IMG] [IMG_BREAK] [IMG_END]
MISTRAL3_PATCH = 4
# (text prefix, LM head, vision prefix, projector prefix) of each on-disk naming (bridges/mistral3_vl.py): the hub's,
# which transformers 5 writes too, and the module names
MISTRAL3_NAMINGS = {"hub": ("language_model.model", "language_model.lm_head", "vision_tower", "multi_modal_projector"),
                    "modules": ("model.language_model", "lm_head", "model.vision_tower",
                                "model.multi_modal_projector")}


def tiny_mistral3_config(*, projector_bias: bool = False, tie_word_embeddings: bool = False, **text_overrides):
    """A 4-layer Mistral decoder (head_dim 16, GQA, untied head as Mistral-Small-3.1's) under a 2-block Pixtral ViT
    (hidden 32, 2 heads, 4-pixel patches, 2x2 patch merger); ``[IMG]`` / ``[IMG_BREAK]`` / ``[IMG_END]`` are ids
    200 - 202."""
    from transformers import Mistral3Config

    text = dict(vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rms_norm_eps=1e-5, sliding_window=None, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=tie_word_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    text.update(text_overrides)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=MISTRAL3_PATCH, rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    return Mistral3Config(text_config=text, vision_config=vision, image_token_index=MISTRAL3_IMG,
                          spatial_merge_size=2, multimodal_projector_bias=projector_bias,
                          tie_word_embeddings=tie_word_embeddings)


def make_tiny_mistral3(folder: str | Path, *, seed: int = 0, naming: str = "hub", max_shard_size: str = "60KB",
                       **config_overrides) -> Path:
    """Write a tiny random Mistral 3 image-text checkpoint (weights under ``naming``'s prefixes, config, a word-level
    tokenizer with the three image tokens) and return its folder."""
    from transformers import Mistral3ForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(tiny_mistral3_config(**config_overrides)).to(torch.float32)
    _randomise(model, scaled=())
    with torch.no_grad():  # NOTE: ln_pre is a norm whose name does not say so
        ln_pre = model.model.vision_tower.ln_pre.weight
        ln_pre.copy_(1.0 + 0.1 * torch.randn_like(ln_pre))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if naming != "hub":
        rename_prefixes(folder, dict(zip(MISTRAL3_NAMINGS["hub"], MISTRAL3_NAMINGS[naming])))
    from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

    tok = make_tiny_tokenizer(folder, vocab_size=TEXT_VOCAB)
    tok.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    tok.save_pretrained(folder)
    return folder


def mistral3_image_tokens(height: int, width: int, *, merge: int = 2) -> list[int]:
    """The ids Pixtral's processor puts for an image of ``height x width`` pixels: per row of merged tokens, one
    ``[IMG]`` per column then ``[IMG_BREAK]``, the last break ``[IMG_END]``."""
    side = MISTRAL3_PATCH * merge
    row = [MISTRAL3_IMG] * (width // side) + [MISTRAL3_BREAK]
    ids = row * (height // side)
    return ids[:-1] + [MISTRAL3_END]


def mistral3_image_prompt(rows: list[list], *, seed: int = 0) -> dict:
    """(``input_ids [b, s]``, ``pixel_values [n, 3, H, W]`` padded bottom-right with zeros to the largest, as
    Pixtral's processor pads them, ``image_sizes [n, 2]``) where a row holds an image's ``(height, width)``; other
    entries are text ids (every row the same length)."""
    generator = torch.Generator().manual_seed(seed)
    ids, sizes = [], []
    for row in rows:
        ids.append([t for x in row for t in (mistral3_image_tokens(*x) if isinstance(x, tuple) else [x])])
        sizes += [x for x in row if isinstance(x, tuple)]
    out = {"input_ids": torch.tensor(ids)}
    if sizes:
        height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
        pixels = torch.zeros(len(sizes), 3, height, width)
        for i, (h, w) in enumerate(sizes):
            pixels[i, :, :h, :w] = torch.randn(3, h, w, generator=generator)
        out.update(pixel_values=pixels, image_sizes=torch.tensor(sizes))
    return out
