"""``multimodal.image_tokens``: a batch's image placeholder tokens against what its images give, per bridge family
(Qwen2.5-VL's ``image_grid_thw`` and merge size, Gemma 3's fixed count a picture, Mistral 3's ``image_sizes``),
the placeholders laid out as each family's processor lays them (``testing.tiny_vl``): the right count passes, one
cut placeholder fails naming the fields and suggesting a larger ``max_length``. Pure functions, no process group.
The two-rank run (one rank's image cut: the same error on both ranks, no hang) is in test_qwen2_5_vl_trl.py."""

from __future__ import annotations

import pytest
import torch

from loongforge_hf.bridges.qwen2_5_vl import get_vl_bridge
from loongforge_hf.multimodal.image_tokens import image_token_problem
from loongforge_hf.testing import tiny_vl


def _cut(batch: dict, token: int) -> dict:
    """``batch`` with the last image placeholder of its first row turned into text (as a truncation loses it)."""
    ids = batch["input_ids"].clone()
    last = int((ids[0] == token).nonzero()[-1])
    ids[0, last] = 5
    return {**batch, "input_ids": ids}


def _qwen2_5_vl():
    bridge = get_vl_bridge(_with_arch(tiny_vl.tiny_vl_config(), "Qwen2_5_VLForConditionalGeneration"))
    token = bridge.image_token_id
    grid = torch.tensor([[1, 4, 4], [1, 2, 6]])  # NOTE: 16 and 12 patches, merged 2x2: 4 and 3 tokens
    ids = torch.tensor([[7, token, token, token, token, 8, 9], [token, token, token, 9, 10, 11, 0]])
    return bridge, {"input_ids": ids, "pixel_values": torch.randn(28, 3 * 2 * 14 * 14), "image_grid_thw": grid}


def _gemma3():
    bridge = get_vl_bridge(_with_arch(tiny_vl.tiny_gemma3_vl_config(), "Gemma3ForConditionalGeneration"))
    ids, types = tiny_vl.gemma3_image_prompt([[5, -1, 6], [-1, 7, 8]])
    return bridge, {"input_ids": ids, "token_type_ids": types, "pixel_values": torch.randn(2, 3, 56, 56)}


def _mistral3():
    bridge = get_vl_bridge(_with_arch(tiny_vl.tiny_mistral3_config(), "Mistral3ForConditionalGeneration"))
    # NOTE: a 16x24 and a 24x8 picture, padded to 24x24: 2x3 and 3x1 merged tokens (8-pixel cells)
    return bridge, tiny_vl.mistral3_image_prompt([[5, (16, 24), 6, 7], [(24, 8), 8, 9, 10, 11, 12]])


def _with_arch(config, arch: str):
    config.architectures = [arch]
    return config


FAMILIES = {"qwen2_5_vl": (_qwen2_5_vl, "image_grid_thw [[1, 4, 4], [1, 2, 6]] take 7"),
            "gemma3": (_gemma3, "pixel_values of shape [2, 3, 56, 56] take 32"),
            "mistral3": (_mistral3, "image_sizes [[16, 24], [24, 8]] take 9")}


@pytest.mark.parametrize("family", FAMILIES)
def test_cut_image_tokens_are_named(family):
    make, given = FAMILIES[family]
    bridge, batch = make()
    assert image_token_problem(bridge, batch, max_length=64) is None
    problem = image_token_problem(bridge, _cut(batch, bridge.image_token_id), max_length=64)
    held = int((batch["input_ids"] == bridge.image_token_id).sum()) - 1
    assert problem is not None and problem.startswith(f"input_ids hold {held} image placeholder tokens"), problem
    assert given in problem and "increase max_length, or set it to None" in problem and "max_length=64" in problem
    # a batch without pixels keeps its placeholders as text (as transformers): nothing to check
    text_only = {k: v for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw", "image_sizes")}
    assert image_token_problem(bridge, text_only) is None


def test_text_bridge_is_not_checked():
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_with_arch(_config("llama"), "LlamaForCausalLM"))
    assert image_token_problem(bridge, {"input_ids": torch.tensor([[1, 2, 3]])}) is None
