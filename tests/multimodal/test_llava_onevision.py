"""LLaVA-OneVision image-text (``LlavaOnevisionForConditionalGeneration``: LLaVA-NeXT's any-resolution crops over a
SigLIP ViT, large pictures' maps shrunk by ``anyres_max_N``, a Qwen2 decoder; videos of 2x2-pooled frames;
multi-image samples of base crops) against transformers, one launch per world size:

- logits, loss and vision gradients (``image_newline``'s included) within 1e-4 (fp32) on three batches
  (``_vl_llava_onevision.BATCHES``): three pictures of three sizes (36, 52 and 46 ``<image>`` tokens: nothing
  unpadded; unpadded; unpadded and shrunk), at TP1 in the hub's and the module naming and at TP2 + SP with the tower
  split; a 2-frame video (9 ``<video>`` tokens) beside a picture, at TP1 and at TP2 with the tower encoder data
  parallel (one item a rank); a sample of two pictures (17 tokens each: base crop and newline) beside a sample of
  one, at TP1 and at TP2 + SP with the tower split; bit-exact round trips;
- a video sample, a two-picture sample and a one-picture sample, each through the processor alone and batched by
  ``DataCollatorForImageText`` (``batch_num_images``, crops padded, the videos' tensor), at TP1, and what the
  collator refuses (videos of different frame counts, ``batch_num_images`` not matching a sample's images);
- greedy (with and without the KV cache) and beam search ``generate`` on the video batch: the same sequences as
  transformers', logits / scores within 1e-4;
- the token count of many picture sizes (alone and in multi-image samples) and of videos against the processor's,
  and the refusals.
"""

from types import SimpleNamespace

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip, read_all
from loongforge_hf.testing.tiny_llava_onevision import (image_token_count, make_tiny_llava_onevision,
                                                        tiny_llava_onevision_config, video_token_count)

from ._vl_gemma3 import SCENARIOS
from ._vl_llava_onevision import checks

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: patch conv (2), table, 3 x 16 block tensors, the projector (4), image_newline
GRADS = 56
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
ENCODER_DP = {"tensor_parallel_size": 2, "vision_data_parallel": True}
# batch name -> (logits shape, <image> tokens a row, <video> tokens a row)
EXPECTED = {"pictures": ((3, 56, 204), [36, 52, 46], [0, 0, 0]), "video": ((2, 56, 204), [0, 52], [9, 0]),
            "multi": ((2, 40, 204), [34, 36], [0, 0]), "collated": ((3, 40, 204), [0, 34, 36], [9, 0, 0])}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llava_onevision")
    return {"hub": make_tiny_llava_onevision(root / "hub"),
            "modules": make_tiny_llava_onevision(root / "modules", naming="modules")}


@pytest.fixture(scope="module")
def one_rank(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("llava-onevision-one-rank")
    hub = str(folders["hub"])
    cases = [(n, str(f), {}, str(out / n), "pictures") for n, f in folders.items()] + \
        [(n, hub, {}, None, n) for n in ("video", "multi", "collated")]
    got = run_distributed(checks, 1, cases=cases, generation=(hub, SCENARIOS), timeout=600)
    return got[0], out


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("llava-onevision-two-ranks")
    hub = str(folders["hub"])
    cases = [("split", hub, SPLIT_SP, str(out / "split"), "pictures"), ("video", hub, ENCODER_DP, None, "video"),
             ("multi", hub, SPLIT_SP, None, "multi")]
    return run_distributed(checks, 2, cases=cases, timeout=600), out


def check(result: dict, batch: str = "pictures") -> None:
    shape, images, videos = EXPECTED[batch]
    assert result["logits_shape"] == shape and result["image_tokens"] == images, result
    assert result["video_tokens"] == videos, result
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


def test_video_and_multi_image_one_rank(one_rank):
    """A video beside a picture, a two-picture sample beside a one-picture sample, at TP1 as transformers."""
    for batch in ("video", "multi"):
        check(one_rank[0][batch], batch)


def test_collated_samples_one_rank(one_rank):
    """A video sample, a two-picture sample and a one-picture sample, each prepared alone and batched by
    ``DataCollatorForImageText`` (``batch_num_images [2, 1]``), at TP1 as transformers on that batch."""
    check(one_rank[0]["collated"], "collated")


def test_collator_refuses_what_cannot_be_batched():
    """Videos of different frame counts (one [videos, frames, C, H, W] tensor) and ``batch_num_images`` that do not
    add up to a sample's images raise, naming the field."""
    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText

    collator = DataCollatorForImageText(pad_token_id=0, image_token_id=200, video_token_id=201, mrope=False)
    ids = torch.tensor([[5, 201, 6]])
    videos = [{"input_ids": ids, "pixel_values_videos": torch.zeros(1, n, 3, 28, 28)} for n in (2, 3)]
    with pytest.raises(ValueError, match=r"pixel_values_videos: videos of \[frames, C, H, W\]"):
        collator(videos)
    image = {"input_ids": ids, "pixel_values": torch.zeros(2, 1, 3, 28, 28), "image_sizes": torch.tensor([[9, 9]] * 2),
             "batch_num_images": torch.tensor([1])}
    with pytest.raises(ValueError, match=r"batch_num_images=\[1\] does not add up to the 2 images"):
        collator([image])
    del image["batch_num_images"]
    assert "batch_num_images" not in collator([image])  # NOTE: only where the samples bring it (LLaVA-NeXT's none)


def test_generate_with_a_video(one_rank):
    """Greedy (cached and uncached) and beam search on the video batch: transformers' sequences, its logits."""
    got = one_rank[0]["generate"]
    assert set(got) == set(SCENARIOS), got
    for result in got.values():
        assert result["same_sequences"] and result["max_diff"] < TOL and result["steps"] >= 4, got


def test_parity_and_round_trip_two_ranks(two_ranks, folders):
    """TP2 + SP with the tower split over TP (pictures; multi-image samples), TP2 with the tower encoder data parallel
    (a video and a picture: one a rank) as transformers; exported bit for bit."""
    got, out = two_ranks
    for rank in got:
        for name, batch, layout in (("split", "pictures", "tensor_parallel"), ("video", "video", "data_parallel"),
                                    ("multi", "multi", "tensor_parallel")):
            check(rank[name], batch)
            assert rank[name]["vision_layout"] == layout, rank[name]
    check_round_trip(folders["hub"], out / "split", side_files=SIDE_FILES)


def test_token_counts_match_the_processor():
    """``<image>`` tokens of pictures of many sizes, alone and in multi-image samples, and ``<video>`` tokens of
    videos (``vision_llava_onevision.onevision_counts``, which the bridge and the tower use) against
    ``LlavaOnevisionProcessor``'s own count."""
    import numpy as np

    from loongforge_hf.bridges.llava_onevision import LlavaOnevisionBridge

    sizes = [(int(h), int(w)) for h, w in np.random.RandomState(0).randint(5, 300, size=(80, 2))] + [(28, 28), (1, 99)]
    bridge = LlavaOnevisionBridge(tiny_llava_onevision_config())
    tokens = bridge.vision_item_tokens(torch.tensor([[0, h, w] for h, w in sizes])).tolist()
    assert tokens == [image_token_count(h, w) for h, w in sizes]
    grid = bridge.image_grid(torch.tensor(sizes[:3]), batch_num_images=[2, 1])
    assert grid[:2, 0].tolist() == [1, 1] and grid[2, 0] > 1
    assert bridge.vision_item_tokens(grid).tolist() == [image_token_count(*sizes[0], alone=False),
                                                        image_token_count(*sizes[1], alone=False),
                                                        image_token_count(*sizes[2])]
    frames = [1, 2, 7]
    _, video_grid = bridge.video_inputs(torch.zeros(1, 7, 3, 28, 28))
    assert video_grid.tolist() == [[7, 0, 0]]
    assert bridge.vision_item_tokens(torch.tensor([[f, 0, 0] for f in frames])).tolist() == \
        [video_token_count(f) for f in frames]


def test_bad_inputs_and_configs_are_refused(folders):
    """Each config refusal raises from the bridge (before any collective); bad ``batch_num_images`` and videos raise
    where the forward reads the inputs (every rank alike, before the model runs); ``batch_num_images`` above 1 for
    another model and per-call overrides of ``vision_aspect_ratio`` raise at forward."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.llava_onevision import LlavaOnevisionBridge
    from loongforge_hf.multimodal.modeling import _refuse_vision_overrides, _sample_images, _tower_inputs

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
    bridge = LlavaOnevisionBridge(config)
    with pytest.raises(ValueError, match=r"batch_num_images=\[2, 1\].*one image a sample"):
        _sample_images(SimpleNamespace(), torch.tensor([2, 1]))
    assert _sample_images(SimpleNamespace(), torch.tensor([1, 1])) == {}
    inputs = {"pixel_values": torch.zeros(3, 2, 3, 28, 28), "image_sizes": torch.tensor([[20, 20]] * 3)}
    with pytest.raises(ValueError, match=r"batch_num_images=\[2, 2\] does not add up to the 3 images"):
        _tower_inputs(bridge, {**inputs, "batch_num_images": torch.tensor([2, 2])}.get)
    for videos in (torch.zeros(1, 2, 3, 28, 21), torch.zeros(2, 3, 28, 28), [torch.zeros(2, 3, 28, 28)],
                   torch.zeros(1, 0, 3, 28, 28)):
        with pytest.raises(ValueError, match=r"pixel_values_videos as one \[videos, frames, C, 28, 28\] tensor"):
            _tower_inputs(bridge, {"pixel_values_videos": videos}.get)
    with pytest.raises(ValueError, match="vision_aspect_ratio='anyres_max_9' differs"):
        _refuse_vision_overrides(config, {"vision_aspect_ratio": "anyres_max_9"})
