"""LLaVA-NeXT-Video image-text (``LlavaNextVideoForConditionalGeneration``: LLaVA-NeXT's any-resolution crops, and
videos whose frames' CLIP features are pooled before the projector) against transformers, one launch per world size:

- logits, loss and vision gradients (``image_newline``'s included) within 1e-4 (fp32) on two rows that each hold a
  3-frame video (12 ``<video>`` tokens) and a picture (52 and 60 ``<image>`` tokens), at TP1 and at TP2 + SP with the
  tower split over TP and TP2 with the tower encoder data parallel; bit-exact round trips;
- greedy (with and without the KV cache) and beam search ``generate`` on prompts with a video and pictures: the same
  sequences as transformers', logits / scores within 1e-4;
- in one process: max pooling's tower against transformers' image and video features, the token counts against
  the processor's, and the refusals.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip, read_all
from loongforge_hf.testing.tiny_llava_next_video import (make_tiny_llava_next_video, tiny_llava_next_video_config,
                                                         video_token_count)

from ._vl_gemma3 import SCENARIOS
from ._vl_llava_next_video import checks

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: class token, patch conv, table, pre-norm (2), 2 x 16 block tensors, the projector
# (4), image_newline
GRADS = 42
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
ENCODER_DP = {"tensor_parallel_size": 2, "vision_data_parallel": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llava_next_video(tmp_path_factory.mktemp("llava_next_video") / "hub")


@pytest.fixture(scope="module")
def one_rank(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("llava-next-video-one-rank")
    got = run_distributed(checks, 1, cases=[("tp1", str(folder), {}, str(out / "tp1"))],
                          generation=(str(folder), SCENARIOS), timeout=600)
    return got[0], out


@pytest.fixture(scope="module")
def two_ranks(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("llava-next-video-two-ranks")
    cases = [("split", str(folder), SPLIT_SP, str(out / "split")), ("encoder_dp", str(folder), ENCODER_DP, None)]
    return run_distributed(checks, 2, cases=cases, timeout=600), out


def check(result: dict) -> None:
    assert result["logits_shape"] == (2, 76, 204), result
    assert result["image_tokens"] == [52, 60] and result["video_tokens"] == [12, 12], result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == GRADS, result


def test_parity_and_round_trip_one_rank(one_rank, folder):
    """TP1 as transformers; exported bit for bit under the hub's names."""
    got, out = one_rank
    check(got["tp1"])
    check_round_trip(folder, out / "tp1", side_files=SIDE_FILES)
    assert "image_newline" in read_all(out / "tp1")


def test_generate_with_a_video_and_pictures(one_rank):
    """Greedy (cached and uncached) and beam search: transformers' sequences, its logits / scores."""
    got = one_rank[0]["generate"]
    assert set(got) == set(SCENARIOS), got
    for result in got.values():
        assert result["same_sequences"] and result["max_diff"] < TOL and result["steps"] >= 4, got


def test_parity_and_round_trip_two_ranks(two_ranks, folder):
    """TP2 + SP with the tower split over TP, TP2 with the tower encoder data parallel, as transformers; the split
    layout exported bit for bit."""
    got, out = two_ranks
    for rank in got:
        for name, layout in (("split", "tensor_parallel"), ("encoder_dp", "data_parallel")):
            check(rank[name])
            assert rank[name]["vision_layout"] == layout, rank[name]
    check_round_trip(folder, out / "split", side_files=SIDE_FILES)


def test_max_pooling_tower_matches_transformers(tmp_path):
    """``spatial_pool_mode="max"``: the tower's embeddings of two pictures and two 2-frame videos, in one call, as
    transformers' ``get_image_features`` then ``get_video_features``; no items (an empty share of encoder data
    parallelism): no rows, still in the graph."""
    import transformers

    from loongforge_hf.bridges.checkpoint_io import CheckpointReader
    from loongforge_hf.bridges.llava_next_video import LlavaNextVideoBridge
    from loongforge_hf.multimodal.modeling import _tower_inputs
    from loongforge_hf.multimodal.vision_weights import load_vision
    from loongforge_hf.testing.tiny_llava_next_video import llava_next_video_inputs

    folder = make_tiny_llava_next_video(tmp_path, seed=3, pool_mode="max")
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).model
    batch = llava_next_video_inputs(folder, ["<image> <video>", "<image> <video>"], [(50, 36), (20, 40)], frames=2)
    with CheckpointReader(folder) as reader, torch.no_grad():
        bridge = LlavaNextVideoBridge(transformers.AutoConfig.from_pretrained(folder), reader.keys())
        tower = bridge.vision_tower()
        load_vision(tower, bridge, reader)
        inputs = _tower_inputs(bridge, batch.get)
        got = tower(torch.cat([inputs["pixel_values"], inputs["pixel_values_videos"]]),
                    torch.cat([inputs["image_grid_thw"], inputs["video_grid_thw"]]))
        want = torch.cat([*ref.get_image_features(batch["pixel_values"], batch["image_sizes"]).pooler_output,
                          ref.get_video_features(batch["pixel_values_videos"]).pooler_output.flatten(0, 1)])
    assert inputs["video_grid_thw"].tolist() == [[2, 0, 0]] * 2 and got.shape == want.shape == (72 + 52 + 16, 64)
    assert (got - want).abs().max() < 1e-5
    empty = tower(torch.zeros(0, 3 * 49), torch.zeros(0, 3, dtype=torch.long))  # NOTE: an empty encoder-DP share
    assert empty.shape == (0, 64) and empty.requires_grad


def test_token_counts_match_the_processor():
    """``<video>`` tokens of videos of several frame counts (``vision_llava_next_video.next_video_counts``, which the
    bridge and the tower use) against ``LlavaNextVideoProcessor``'s own count, pictures' beside them as
    LLaVA-NeXT's."""
    from loongforge_hf.bridges.llava_next import LlavaNextBridge
    from loongforge_hf.bridges.llava_next_video import LlavaNextVideoBridge
    from loongforge_hf.testing.tiny_llava_next import tiny_llava_next_config

    bridge = LlavaNextVideoBridge(tiny_llava_next_video_config())
    frames, pictures = [1, 2, 7], [[0, 20, 40], [0, 50, 36], [0, 1, 99]]
    grid = torch.tensor([[f, 0, 0] for f in frames] + pictures)
    assert bridge.vision_item_tokens(grid).tolist() == [video_token_count(f) for f in frames] + \
        LlavaNextBridge(tiny_llava_next_config()).vision_item_tokens(torch.tensor(pictures)).tolist()
    patches, video_grid = bridge.video_inputs(torch.zeros(2, 7, 3, 28, 28))
    assert video_grid.tolist() == [[7, 0, 0]] * 2 and patches.shape == (2 * 7 * 16, 3 * 49)


def test_bad_inputs_and_configs_are_refused():
    """Each config refusal raises from the bridge (before any collective); videos not as one ``[videos, frames, C,
    28, 28]`` tensor raise where the forward reads the inputs (every rank alike, before the model runs)."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.llava_next_video import LlavaNextVideoBridge
    from loongforge_hf.multimodal.modeling import _tower_inputs

    for field, value, message in (("spatial_pool_mode", "conv", "spatial_pool_mode='conv' is not supported"),
                                  ("spatial_pool_stride", 0, "spatial_pool_stride=0 must be an int from 1 to the 4"),
                                  ("spatial_pool_stride", 5, "spatial_pool_stride=5"),
                                  ("vision_feature_select_strategy", "full", "only 'default'")):
        config = tiny_llava_next_video_config()
        setattr(config, field, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            LlavaNextVideoBridge(config)
    bridge = LlavaNextVideoBridge(tiny_llava_next_video_config())
    for videos in (torch.zeros(1, 2, 3, 28, 21), torch.zeros(2, 3, 28, 28), [torch.zeros(2, 3, 28, 28)],
                   torch.zeros(1, 0, 3, 28, 28)):
        with pytest.raises(ValueError, match=r"LLaVA-NeXT-Video takes pixel_values_videos as one \[videos, frames"):
            _tower_inputs(bridge, {"pixel_values_videos": videos}.get)


def test_collator_from_processor_batches_as_the_processor(folder):
    """``DataCollatorForImageText.from_processor`` with a ``LlavaNextVideoProcessor`` (made without its video
    processor, which needs torchvision): each row's tokens, crops, image size and video collated alone give the batch
    the processor made for both rows (ids and mask padded to 4, labels -100 on padding and vision tokens, the crops
    padded to the most, the videos stacked); ``packing=True`` takes it too (no 3-D positions to compute)."""
    from transformers import AutoTokenizer, LlavaNextVideoProcessor

    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_llava import IMAGE
    from loongforge_hf.testing.tiny_llava_next_video import VIDEO

    from ._vl_llava_next_video import make_batch

    processor = object.__new__(LlavaNextVideoProcessor)
    processor.__dict__.update(tokenizer=AutoTokenizer.from_pretrained(folder), image_token_id=IMAGE,
                              video_token_id=VIDEO)
    want = make_batch(folder)
    features = []
    for row in range(2):
        real = want["attention_mask"][row].bool()
        crops = want["pixel_values"][row]
        crops = crops[:int(crops.flatten(1).abs().sum(-1).gt(0).sum())]  # NOTE: without the processor's zero crops
        features.append({"input_ids": want["input_ids"][row][real], "pixel_values": crops[None],
                         "image_sizes": want["image_sizes"][row:row + 1],
                         "pixel_values_videos": want["pixel_values_videos"][row:row + 1]})
    got = DataCollatorForImageText.from_processor(processor, pad_to_multiple_of=4)(features)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    packed = DataCollatorForImageText.from_processor(processor, packing=True)(features)
    assert torch.equal(packed["pixel_values_videos"], want["pixel_values_videos"])
