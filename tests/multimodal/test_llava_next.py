"""LLaVA-NeXT image-text (``LlavaNextForConditionalGeneration``: LLaVA's CLIP ViT, projector and decoders over
any-resolution crops, the tiles' features unpadded with ``image_newline`` per row) against transformers, each world
size one launch (a module fixture) whose checks the tests below read:

- logits, loss and vision gradients (``image_newline``'s included) within 1e-4 (fp32) with three pictures of three
  sizes and aspect ratios in one batch (4, 5 and 3 crops; 60, 72 and 52 ``<image>`` tokens), in each layout of the
  vision tower and the language model; three on-disk namings, the Qwen2 variant's feature-layer list; bit-exact
  round trips (``image_newline`` included);
- ``generate`` (greedy cached and uncached, beams) as transformers';
- the processor's samples through the collator (crops padded to the most), LoongTrainer against
  transformers.Trainer;
- the token count of every picture size against the processor's, and the refusals;
- LoRA against PEFT: ``target_modules=["q_proj", "v_proj"]`` (rsLoRA; the language model's and CLIP's) and
  "all-linear" (the language model's, CLIP's and the projector's linears) with a language norm in
  ``modules_to_save``, the same seed on both sides (random B), on the any-resolution batch: logits and loss within
  1e-5, every adapter's gradient within 5e-5 of its largest entry (those of the ViT block after the feature layer
  have none in PEFT and a zero one here), PEFT's counts, ``target_modules`` and the adapter file's names and shapes,
  the adapter folder in ``PeftModel.from_pretrained`` and the merged export in transformers (1e-5; merged 3e-5); at
  TP1 and at TP2 + SP with the tower split.
"""

import tempfile

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_llava_next import PINPOINTS, make_tiny_llava_next, tiny_llava_next_config

from ._vl_llava_next import LORA_CASES, SPLIT_SP, checks
from ._vl_llava import LORA_IDLE, LORA_SAVED, LORA_TARGETS
from ._vl_parity import TWO_RANKS, check_generate, check_llava_two_ranks, check_lora_vs_peft

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: LLaVA's (class token, patch conv, table, pre-norm (2), 2 x 16 block tensors, the
# projector (4; the qwen2 variant's without biases: 2)) and image_newline
GRADS = {"llama": 42, "qwen2": 40}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """A Llama decoder in the hub's naming; a Mistral one in transformers 5's; the Qwen2 variant (tied head, features
    of hidden states 0 and 2, projector without biases) in the module naming."""
    root = tmp_path_factory.mktemp("llava_next")
    return {"llama": make_tiny_llava_next(root / "llama"),
            "mistral": make_tiny_llava_next(root / "mistral", variant="mistral", naming="transformers"),
            "qwen2": make_tiny_llava_next(root / "qwen2", variant="qwen2", naming="modules")}


@pytest.fixture(scope="module")
def one_rank(folders, tmp_path_factory):
    """TP1: each checkpoint compared and exported under its own names, and a text-only batch; generate; the
    collator and the trainers."""
    out = tmp_path_factory.mktemp("llava-next-one-rank")
    cases = [(n, str(src), {}, str(out / n), {}) for n, src in folders.items()]
    cases.append(("text_only", str(folders["llama"]), {}, None, {"text_only": True}))
    got = run_distributed(checks, 1, cases=cases, folder=str(folders["llama"]), generate={"tp1": {}},
                          out_dir=str(out), lora=LORA_CASES[1], train=True, timeout=600)
    return got[0], out


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory):
    """TP2 with sequence parallelism and the tower split over TP; TP2 with the tower encoder-data-parallel (the
    crops of whole pictures shared out) and both components recomputed; PP2 (forward); CP2 (pictures span chunks of
    both ranks; gradients summed over the CP ranks); the Qwen2 variant split over TP2 + SP; generate at TP2 + SP
    with the tower split."""
    out = tmp_path_factory.mktemp("llava-next-two-ranks")
    cases = [(n, str(folders["llama"]), layout, str(out / n), {}) for n, layout in TWO_RANKS.items()]
    cases.append(("qwen2_split_sp", str(folders["qwen2"]), SPLIT_SP, str(out / "qwen2_split_sp"), {}))
    got = run_distributed(checks, 2, cases=cases, folder=str(folders["llama"]), generate={"tp2_sp": SPLIT_SP},
                          out_dir=str(out), lora=LORA_CASES[2], timeout=600)
    return got, out


def check(result: dict, *, grads: int | None) -> None:
    assert result["logits_shape"] == (2, 140, 204) and result["image_tokens"] == [132, 52], result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads is not None:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == grads, result


def test_parity_round_trip_and_generate_one_rank(one_rank, folders):
    """TP1 in each naming (a text-only batch too), each exported under its own names; greedy (cached, uncached) and
    beam ``generate`` with left-padded prompts of two pictures and one: the same tokens, logits and scores within
    1e-4."""
    got, out = one_rank
    for name in folders:
        check(got["parity"][name], grads=GRADS["qwen2" if name == "qwen2" else "llama"])
        _check_round_trip(folders[name], out / name, side_files=SIDE_FILES)
    text_only = got["parity"]["text_only"]
    assert text_only["logit_diff"] < TOL and text_only["loss_diff"] < TOL and text_only["image_tokens"] == [0, 0]
    hub, tf5, modules = (read_all(out / n) for n in ("llama", "mistral", "qwen2"))
    assert "image_newline" in hub and "vision_tower.vision_model.encoder.layers.2.mlp.fc2.bias" in hub
    assert "image_newline" in tf5 and "vision_tower.post_layernorm.weight" in tf5
    assert "model.image_newline" in modules and not any("lm_head" in n for n in modules)
    check_generate(got["generate"])


def test_parity_round_trip_and_generate_two_ranks(two_ranks, folders):
    """The layouts of ``two_ranks`` as transformers (PP2: logits and loss), each exported bit for bit."""
    check_llava_two_ranks(*two_ranks, folders, check=check, grads=GRADS, side_files=SIDE_FILES)


@pytest.mark.parametrize("ranks", [1, 2])
def test_lora_matches_peft(one_rank, two_ranks, ranks):
    """TP1: "qv" and "all_linear"; TP2 + SP with the tower split: "all_linear"."""
    check_lora_vs_peft([one_rank[0]] if ranks == 1 else two_ranks[0],
                       {case: names for case, (_, names) in LORA_CASES[ranks].items()}, targets=LORA_TARGETS,
                       idle=LORA_IDLE, saved=LORA_SAVED)


def test_collated_batches_train_as_transformers(one_rank, folders):
    """Samples through the tiny ``LlavaNextProcessor`` one at a time (pictures of 4 and 5 crops) through
    DataCollatorForImageText: the crops padded to the most; logits as transformers' on the padded batch, packed (one
    row, 2-D positions) as padded; LoongTrainer logs transformers.Trainer's three losses with every component
    trained, and both move ``image_newline``."""
    got, out = one_rank
    collated = got["collated"]
    assert collated["pixel_values"] == (3, 5, 3, 28, 28) and collated["image_tokens"] == 72 + 60 + 72, collated
    assert collated["packed_shape"][0] == 1 and len(collated["positions"]) == 2, collated
    assert collated["padded_diff"] < TOL and collated["packed_diff"] < 1e-5, collated
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    src = read_all(folders["llama"])["image_newline"]
    for side in ("hf", "loong"):
        trained = read_all(out / "train" / side / "final")["image_newline"]
        assert not torch.equal(src, trained), side


def test_token_counts_match_the_processor():
    """Crops and ``<image>`` tokens of pictures of many sizes and aspect ratios (``vision_llava_next.anyres_counts``,
    which the bridge and the tower use) against the processor's own count and its crops; both namings of
    ``image_newline``."""
    import numpy as np
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from loongforge_hf.bridges.llava_next import LlavaNextBridge
    from loongforge_hf.testing.tiny_llava import make_llava_tokenizer

    rng = np.random.RandomState(0)
    sizes = [(int(h), int(w)) for h, w in rng.randint(5, 200, size=(60, 2))] + [(28, 28), (56, 28), (28, 84), (1, 99)]
    bridge = LlavaNextBridge(tiny_llava_next_config())
    grid = torch.tensor([[0, h, w] for h, w in sizes])
    tokens = bridge.vision_item_tokens(grid).tolist()
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=PINPOINTS)
    with tempfile.TemporaryDirectory() as folder:
        processor = LlavaNextProcessor(image_processor=images, tokenizer=make_llava_tokenizer(folder), patch_size=7,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
    want = [processor._get_number_of_features(h, w, 28, 28) - 1 for h, w in sizes]
    assert tokens == want
    pictures = [rng.randint(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes[:12]]
    pixels = images(pictures, return_tensors="pt")
    patches, rows = bridge.vision_inputs(pixels["pixel_values"], None, image_sizes=pixels["image_sizes"])
    crops = rows[:, 0].tolist()
    assert rows[:, 1:].tolist() == [list(s) for s in sizes[:12]] and patches.shape[0] == 16 * sum(crops)
    for image, n in zip(pixels["pixel_values"], crops):  # NOTE: the processor pads each image with zero crops
        assert image[n:].abs().sum() == 0 and image[n - 1].abs().sum() > 0
    assert bridge.newline_name == "image_newline"
    modules = LlavaNextBridge(tiny_llava_next_config(), ["model.language_model.embed_tokens.weight"])
    assert modules.newline_name == "model.image_newline" and "model.image_newline" in modules.expected_hf_shapes()


def test_bad_inputs_and_configs_are_refused():
    """Each config refusal raises from the bridge (before any collective); inputs whose crops disagree with their
    ``image_sizes`` raise a ValueError naming both."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.llava_next import LlavaNextBridge

    for top, vision, message in (({"vision_feature_select_strategy": "full"}, {}, "only 'default'"),
                                 ({"image_grid_pinpoints": [[28, 50]]}, {}, r"image_grid_pinpoints=\[\[28, 50\]\]"),
                                 ({"image_grid_pinpoints": []}, {}, "positive multiples"),
                                 ({"image_grid_pinpoints": [[28, 56, 84]]}, {}, "pair"),
                                 ({"vision_feature_layer": 4}, {}, "vision_feature_layer=4: each must index"),
                                 ({}, {"model_type": "siglip_vision_model"}, "only 'clip_vision_model'")):
        config = tiny_llava_next_config()
        for k, value in top.items():
            setattr(config, k, value)
        for k, value in vision.items():
            setattr(config.vision_config, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            LlavaNextBridge(config)
    bridge = LlavaNextBridge(tiny_llava_next_config())
    sizes = torch.tensor([[40, 90], [20, 40]])  # NOTE: 4 and 3 crops
    with pytest.raises(ValueError, match=r"hold 6 crops; the images of image_sizes \[\[40, 90\], \[20, 40\]\] take"):
        bridge.vision_inputs(torch.zeros(6, 3, 28, 28), None, image_sizes=sizes)
    with pytest.raises(ValueError, match=r"do not hold the \[4, 3\] crops"):
        bridge.vision_inputs(torch.zeros(2, 3, 3, 28, 28), None, image_sizes=sizes)
    with pytest.raises(ValueError, match="without image_sizes"):
        bridge.vision_inputs(torch.zeros(2, 4, 3, 28, 28), None)
    tower = bridge.vision_tower()
    with pytest.raises(ValueError, match=r"take \[4, 3\] crops .* grid_thw gives \[4, 4\]"):
        tower(torch.zeros(8 * 16, 3 * 49), torch.tensor([[4, 40, 90], [4, 20, 40]]))
