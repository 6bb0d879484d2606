"""LLaVA-OneVision image-text (``LlavaOnevisionForConditionalGeneration``: LLaVA-NeXT's any-resolution crops over a
SigLIP ViT, large pictures' maps shrunk by ``anyres_max_N``, a Qwen2 decoder) against transformers, one launch per
world size:

- logits, loss and vision gradients (``image_newline``'s included) within 1e-4 (fp32) on three pictures of three
  sizes (36, 52 and 46 ``<image>`` tokens: nothing unpadded; unpadded; unpadded and shrunk), at TP1 in the hub's and
  the module naming and at TP2 + SP with the tower split; bit-exact round trips;
- the token count of many picture sizes against the processor's, and the refusals.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip, read_all
from loongforge_hf.testing.tiny_llava_onevision import (image_token_count, make_tiny_llava_onevision,
                                                        tiny_llava_onevision_config)

from ._vl_llava_onevision import checks

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: patch conv (2), table, 3 x 16 block tensors, the projector (4), image_newline
GRADS = 56
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llava_onevision")
    return {"hub": make_tiny_llava_onevision(root / "hub"),
            "modules": make_tiny_llava_onevision(root / "modules", naming="modules")}


@pytest.fixture(scope="module")
def one_rank(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("llava-onevision-one-rank")
    got = run_distributed(checks, 1, cases=[(n, str(f), {}, str(out / n)) for n, f in folders.items()], timeout=600)
    return got[0], out


def check(result: dict) -> None:
    assert result["logits_shape"] == (3, 56, 204) and result["image_tokens"] == [36, 52, 46], result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == GRADS, result


def test_parity_and_round_trip_one_rank(one_rank, folders):
    """TP1 in the hub's and the module naming as transformers; each exported bit for bit under its own names."""
    got, out = one_rank
    for name in folders:
        check(got[name])
        check_round_trip(folders[name], out / name, side_files=SIDE_FILES)
    assert "image_newline" in read_all(out / "hub") and "model.image_newline" in read_all(out / "modules")
    assert "vision_tower.vision_model.embeddings.patch_embedding.bias" in read_all(out / "hub")


def test_parity_and_round_trip_two_ranks(folders, tmp_path):
    """TP2 + SP with the tower split over TP as transformers; exported bit for bit."""
    got = run_distributed(checks, 2, cases=[("split", str(folders["hub"]), SPLIT_SP, str(tmp_path / "split"))],
                          timeout=600)
    for rank in got:
        check(rank["split"])
        assert rank["split"]["vision_layout"] == "tensor_parallel"
    check_round_trip(folders["hub"], tmp_path / "split", side_files=SIDE_FILES)


def test_token_counts_match_the_processor():
    """``<image>`` tokens of pictures of many sizes (``vision_llava_onevision.onevision_counts``, which the bridge
    and the tower use) against ``LlavaOnevisionProcessor``'s own count."""
    import numpy as np

    from loongforge_hf.bridges.llava_onevision import LlavaOnevisionBridge

    sizes = [(int(h), int(w)) for h, w in np.random.RandomState(0).randint(5, 300, size=(80, 2))] + [(28, 28), (1, 99)]
    bridge = LlavaOnevisionBridge(tiny_llava_onevision_config())
    tokens = bridge.vision_item_tokens(torch.tensor([[0, h, w] for h, w in sizes])).tolist()
    assert tokens == [image_token_count(h, w) for h, w in sizes]


def test_bad_inputs_and_configs_are_refused(folders):
    """Each config refusal raises from the bridge (before any collective); multi-image samples and per-call
    overrides of ``vision_aspect_ratio`` raise at forward."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.llava_onevision import LlavaOnevisionBridge
    from loongforge_hf.multimodal.modeling import _refuse_vision_overrides

    for top, vision, message in (({"vision_feature_select_strategy": "default"}, {}, "only 'full'"),
                                 ({"vision_aspect_ratio": "anyres"}, {}, "vision_aspect_ratio='anyres' must be"),
                                 ({"image_grid_pinpoints": [[28, 50]]}, {}, "positive multiples"),
                                 ({}, {"vision_use_head": True}, "vision_use_head=True"),
                                 ({}, {"model_type": "clip_vision_model"}, "only 'siglip_vision_model'")):
        config = tiny_llava_onevision_config()
        for k, value in top.items():
            setattr(config, k, value)
        for k, value in vision.items():
            setattr(config.vision_config, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            LlavaOnevisionBridge(config)
    config = tiny_llava_onevision_config()
    with pytest.raises(ValueError, match=r"batch_num_images=\[2, 1\].*not supported"):
        _refuse_vision_overrides(config, {"batch_num_images": torch.tensor([2, 1])})
    with pytest.raises(ValueError, match="vision_aspect_ratio='anyres_max_9' differs"):
        _refuse_vision_overrides(config, {"vision_aspect_ratio": "anyres_max_9"})
    _refuse_vision_overrides(config, {"batch_num_images": torch.tensor([1, 1])})
