"""LLaVA's vision tower: a CLIP ViT (patch convolution without bias, a class token, absolute positions, the
pre-LayerNorm, LayerNorm blocks with q / k / v biases and a quick-GELU MLP) read at ``vision_feature_layer``, the class
token dropped, and LLaVA's Linear-GELU-Linear projector; optionally split over TP.

Choices:
- Inputs as the Qwen towers take them, so the chunk's machinery (encoder data parallel, CP shares of the images,
  beam copies) serves it unchanged: ``pixel_values [N, C * P * P]``, each image's patches row-major
  (``vision.as_image_patches`` turns the processor's ``[n, C, H, W]`` into them), and ``grid_thw [n, 3]`` =
  ``(1, H / P, W / P)`` per image; ``merge`` is 1: an image gives ``h w`` tokens (its class token dropped, the
  ``"default"`` feature strategy).
- The arithmetic is transformers' (``CLIPVisionModel``, ``LlavaModel.get_image_features``,
  ``LlavaMultiModalProjector``): the convolution as one matmul, the class token first, the whole position table added
  (images at the configured ``image_size`` only: CLIP refuses others unless asked to interpolate, which LLaVA never
  asks), ``pre_layrnorm``, full attention within each image, its class token included, without rope. The features
  are the hidden states after ``k`` blocks for each ``k`` of ``feature_layers`` (transformers' ``hidden_states[k]``,
  0 being the pre-LayerNorm's output), class tokens dropped, concatenated on the feature axis when there are several;
  then ``linear_1``, the projector's activation, ``linear_2``.
- Blocks after the deepest feature layer and ``post_layernorm`` (CLIP's pooled output, which LLaVA never reads) are
  built, so their tensors load, round-trip and take adapters as transformers' tree has them, but never run: their
  own weights are frozen at build (transformers gives them no gradient, so its optimizers leave them as they are),
  and any trainable parameter among them (a LoRA adapter PEFT would put there too) enters the output as a zero term,
  so megatron's DDP sees every trainable parameter's gradient (``chunk.py`` does the same for batches without
  images).
- Tensor parallelism, FP8 and ``recompute`` as the Qwen towers (``vision_qwen3.Qwen3VisionBlock``: SigLIP's and
  CLIP's encoder layer, ``vision.VisionAttention`` with fused ``qkv`` rows): attention split by heads, ``fc1`` by rows
  and ``fc2`` by columns (biases after the reduction); the norms, the class token, the table, the patch embedding and
  the projector are replicated.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from loongforge_hf.multimodal.vision import PatchEmbed, VisionLinear, _cu, run_block
from loongforge_hf.multimodal.vision_qwen3 import Qwen3VisionBlock


def square_side(value, name: str) -> int:
    """``image_size`` / ``patch_size`` of a CLIP config (an int or a square pair) as one int; ValueError otherwise."""
    pair = tuple(value) if isinstance(value, (list, tuple)) else (value, value)
    if len(pair) != 2 or pair[0] != pair[1]:
        raise ValueError(f"vision_config.{name}={value!r} must be square.")
    return int(pair[0])


def patch_grid_side(v, *, heads: bool = True) -> int:
    """The side of a ViT config's square patch grid (``image_size // patch_size``); ValueError naming the fields where
    a size is not square, the image not a whole number of patches or (``heads``) ``hidden_size`` not a multiple of
    ``num_attention_heads``."""
    image, patch = square_side(v.image_size, "image_size"), square_side(v.patch_size, "patch_size")
    if image % patch or (heads and v.hidden_size % v.num_attention_heads):
        raise ValueError(f"vision_config: image_size={v.image_size} must be a multiple of patch_size={v.patch_size}"
                         + (", hidden_size of num_attention_heads." if heads else "."))
    return image // patch


def check_square_grids(grid_thw: torch.Tensor, side: int, takes: str) -> int:
    """The number of images in ``grid_thw`` ``[n, 3]`` when every one is a single ``side x side`` grid of patches;
    ValueError (``takes`` first: what the tower takes) otherwise."""
    for t, h, w in grid_thw.tolist():
        if (t, h, w) != (1, side, side):
            raise ValueError(f"{takes} ({side}x{side} patches); got a {t}x{h}x{w} grid.")
    return grid_thw.shape[0]


class LlavaProjector(nn.Module):
    """``[n, width]`` selected features -> ``[n, text_hidden]``: Linear, act, Linear (biases as configured)."""

    def __init__(self, width: int, text_hidden: int, *, act: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = VisionLinear(width, text_hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = VisionLinear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ClipTower(nn.Module):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [N, text_hidden]`` image embeddings; ``feature_layers``:
    the hidden states read (0 .. ``num_hidden_layers``, as transformers' non-negative ``hidden_states`` indices)."""

    merge = 1
    family = "CLIP"
    lead = 1  # NOTE: tokens before the patches' (the class token), dropped from the features

    def __init__(self, config, *, text_hidden: int, feature_layers: tuple[int, ...], projector_act: str,
                 projector_bias: bool, tp_group=None, recompute: bool = False) -> None:
        super().__init__()
        d, patch = config.hidden_size, square_side(config.patch_size, "patch_size")
        self.config = config
        self.recompute = recompute
        self.feature_layers = tuple(feature_layers)
        self.side = square_side(config.image_size, "image_size") // patch
        self.build_embeddings(config, d, patch)
        self.blocks = nn.ModuleList([
            Qwen3VisionBlock(config, tp_group=tp_group, heads=config.num_attention_heads, eps=config.layer_norm_eps)
            for _ in range(config.num_hidden_layers)])
        self.post_layernorm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.projector = LlavaProjector(d * len(self.feature_layers), text_hidden, act=projector_act,
                                        bias=projector_bias)
        for module in self.unused():
            module.requires_grad_(False)

    def build_embeddings(self, config, d: int, patch: int) -> None:
        """CLIP's: the patch convolution without bias, the class token, the position table, the pre-LayerNorm."""
        self.patch_embed = PatchEmbed(SimpleNamespace(hidden_size=d, patch_size=patch,
                                                      num_channels=config.num_channels))
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.position_embedding = nn.Parameter(torch.zeros(self.side * self.side + 1, d))
        self.pre_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def embed(self, pixel_values: torch.Tensor, n: int) -> torch.Tensor:
        """``[n, lead + side^2, d]``: the ``n`` images' tokens before the blocks, the class token first."""
        d = self.config.hidden_size
        x = self.patch_embed(pixel_values).reshape(n, self.side * self.side, d)
        x = torch.cat([self.class_embedding.to(x.dtype).expand(n, 1, d), x], dim=1)
        return self.pre_norm(x + self.position_embedding.to(x.dtype))

    def unused(self) -> list[nn.Module]:
        """The modules the features never pass through: the blocks after the deepest feature layer, the post-norm."""
        return [*self.blocks[max(self.feature_layers):], self.post_layernorm]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        n = check_square_grids(grid_thw, self.side,
                               f"LLaVA's {self.family} tower takes {self.config.image_size}-pixel images")
        return self.touch_unused(self.projector(self.features(pixel_values, n).flatten(0, 1)))

    def features(self, pixel_values: torch.Tensor, n: int) -> torch.Tensor:
        """``[n, side^2, width]``: the ``n`` images' selected features (``feature_layers``, the class token dropped),
        before the projector."""
        side, d, lead = self.side, self.config.hidden_size, self.lead
        x = self.embed(pixel_values, n).reshape(-1, d)
        cu_images = _cu([side * side + lead] * n).to(x.device)
        states = {0: x}
        for k, block in enumerate(self.blocks[:max(self.feature_layers)], start=1):
            x = states[k] = run_block(self, block, x, cu_images, None, None)
        return torch.cat([states[k].reshape(n, side * side + lead, d)[:, lead:] for k in self.feature_layers], dim=-1)

    def touch_unused(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus a zero term of each trainable parameter of ``unused`` (see the module docstring)."""
        idle = [p for module in self.unused() for p in module.parameters() if p.requires_grad]
        if idle and torch.is_grad_enabled():
            out = out + 0.0 * sum(p.reshape(-1)[:1].sum() for p in idle).to(out.dtype)
        return out
