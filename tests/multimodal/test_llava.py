"""LLaVA image-text (``LlavaForConditionalGeneration``: CLIP ViT read at ``vision_feature_layer``, two-layer MLP
projector, Llama / Mistral / Qwen2 decoder) against transformers and PEFT, each world size one launch (a module
fixture) whose checks the tests below read:

- logits, loss and vision gradients within 1e-4 (fp32) with three 28x28 images in one batch, in each layout of the
  vision tower and the language model; the four on-disk namings transformers reads, a feature-layer list; bit-exact
  round trips (the ViT block after the feature layer and ``post_layernorm``, never run, included);
- ``generate`` (greedy cached and uncached, beams) as transformers';
- the processor's samples through the collator, LoongTrainer against transformers.Trainer;
- LoRA against PEFT: ``target_modules=["q_proj", "v_proj"]`` (rsLoRA; in the language model and in CLIP, where they
  are two of the three blocks of the tower's fused ``qkv``) and "all-linear" (the language model's and CLIP's linears
  and the projector's two) with a language norm in ``modules_to_save``, the same seed on both sides (random B):
  logits and loss within 1e-5, every adapter's gradient within 5e-5 of its largest entry (those of the ViT block
  after the feature layer, which PEFT adapts too, have none in PEFT and a zero one here), PEFT's counts,
  ``target_modules`` and the adapter file's names and shapes, the adapter folder in ``PeftModel.from_pretrained`` and
  the merged export in transformers (1e-5; merged 3e-5).
"""

from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_llava import make_tiny_llava, tiny_llava_config

from ._vl_llava import LORA_CASES, LORA_IDLE, LORA_SAVED, LORA_TARGETS, TEXT_ROWS, checks, make_batch
from ._vl_parity import TWO_RANKS, check_generate, check_llava_two_ranks, check_lora_vs_peft

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: class token, patch conv, table, pre-norm (2), 2 x 16 block tensors (block 2 and
# post_layernorm get none), the projector (4; the qwen2 variant's without biases: 2)
GRADS = {"llama": 41, "qwen2": 39}
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """llava-1.5's shape in the hub's naming; its Mistral decoder in transformers 5's; the Qwen2 variant (tied head,
    features of hidden states 0 and 2 concatenated, projector without biases) in the module naming, and with the ViT
    under ``vision_model`` there too."""
    root = tmp_path_factory.mktemp("llava")
    return {"llama": make_tiny_llava(root / "llama"),
            "mistral": make_tiny_llava(root / "mistral", variant="mistral", naming="transformers"),
            "qwen2": make_tiny_llava(root / "qwen2", variant="qwen2", naming="modules"),
            "nested": make_tiny_llava(root / "nested", variant="qwen2", naming="modules_nested")}


def launch(folders: dict, out: Path, ranks: int, cases: list, generate: dict) -> list:
    return run_distributed(checks, ranks, cases=cases, folder=str(folders["llama"]), generate=generate,
                           lora=LORA_CASES[ranks], folders={k: str(v) for k, v in folders.items()}, out_dir=str(out),
                           train=ranks == 1, timeout=600)


@pytest.fixture(scope="module")
def one_rank(folders, tmp_path_factory):
    """TP1: each checkpoint compared and exported under its own names, and a text-only batch; generate; the
    collator and the trainers; LoRA."""
    out = tmp_path_factory.mktemp("llava-one-rank")
    cases = [(n, str(src), {}, str(out / n), {}) for n, src in folders.items()]
    cases.append(("text_only", str(folders["llama"]), {}, None, {"batch": make_batch(TEXT_ROWS)}))
    return launch(folders, out, 1, cases, {"tp1": {}})[0], out


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory):
    """TP2 with sequence parallelism and the tower split over TP (q / k / v fused by heads); TP2 with the tower
    encoder-data-parallel and both components recomputed; PP2 (forward); CP2 (an image spans chunks of both ranks;
    gradients summed over the CP ranks); the Qwen2 variant split over TP2 + SP; generate at TP2 + SP with the tower
    split; LoRA at TP2 + SP with the tower split."""
    out = tmp_path_factory.mktemp("llava-two-ranks")
    cases = [(n, str(folders["llama"]), layout, str(out / n), {}) for n, layout in TWO_RANKS.items()]
    cases.append(("qwen2_split_sp", str(folders["qwen2"]), SPLIT_SP, str(out / "qwen2_split_sp"), {}))
    return launch(folders, out, 2, cases, {"tp2_sp": SPLIT_SP}), out


def check(result: dict, *, grads: int | None) -> None:
    assert result["logits_shape"] == (2, 40, 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads is not None:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == grads, result


def test_parity_round_trip_and_generate_one_rank(one_rank, folders):
    """TP1 in each naming (a text-only batch too), each exported under its own names; greedy (cached, uncached) and
    beam ``generate`` with left-padded prompts of two images and one: the same tokens, logits and scores within
    1e-4."""
    got, out = one_rank
    for name in folders:
        check(got["parity"][name], grads=GRADS["qwen2" if name in ("qwen2", "nested") else "llama"])
        _check_round_trip(folders[name], out / name, side_files=SIDE_FILES)
    text_only = got["parity"]["text_only"]
    assert text_only["logit_diff"] < TOL and text_only["loss_diff"] < TOL
    hub, tf5, nested = (read_all(out / n) for n in ("llama", "mistral", "nested"))
    assert "language_model.lm_head.weight" in hub and "vision_tower.vision_model.encoder.layers.2.mlp.fc2.bias" in hub
    assert "vision_tower.post_layernorm.weight" in tf5
    assert "model.vision_tower.vision_model.embeddings.class_embedding" in nested
    assert not any("lm_head" in n for n in nested)
    check_generate(got["generate"])


def test_parity_round_trip_and_generate_two_ranks(two_ranks, folders):
    """The layouts of ``two_ranks`` as transformers (PP2: logits and loss), each exported bit for bit."""
    check_llava_two_ranks(*two_ranks, folders, check=check, grads=GRADS, side_files=SIDE_FILES)


@pytest.mark.parametrize("ranks", [1, 2])
def test_lora_matches_peft(one_rank, two_ranks, ranks):
    """TP1: "qv" and "all_linear"; TP2 + SP with the tower split: "all_linear", and "qv" on the Qwen2 variant."""
    check_lora_vs_peft([one_rank[0]] if ranks == 1 else two_ranks[0],
                       {case: names for case, (_, _, names) in LORA_CASES[ranks].items()}, targets=LORA_TARGETS,
                       idle=LORA_IDLE, saved=LORA_SAVED)


def test_bad_configs_are_refused():
    """Each refusal raises from the bridge (the first thing ``from_pretrained`` builds, before any collective)."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.llava import LlavaBridge

    for top, vision, message in (({"vision_feature_select_strategy": "full"}, {}, "only 'default'"),
                                 ({"vision_feature_layer": 4}, {}, "vision_feature_layer=4: each must index"),
                                 ({"vision_feature_layer": [-1, -5]}, {}, r"vision_feature_layer=\[-1, -5\]"),
                                 ({"vision_feature_layer": []}, {}, r"vision_feature_layer=\[\]"),
                                 ({"projector_hidden_act": "nope"}, {}, "projector_hidden_act='nope'"),
                                 ({}, {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
                                 ({}, {"hidden_act": "nope"}, "hidden_act='nope'"),
                                 ({}, {"patch_size": (7, 8)}, "must be square"),
                                 ({}, {"image_size": 30}, "must be a multiple of patch_size"),
                                 ({}, {"model_type": "siglip_vision_model"}, "only 'clip_vision_model'")):
        config = tiny_llava_config()
        for k, value in top.items():
            setattr(config, k, value)
        for k, value in vision.items():
            setattr(config.vision_config, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            LlavaBridge(config)
    with pytest.raises(UnsupportedConfigError, match="text_config.model_type='gemma' is not supported"):
        LlavaBridge(tiny_llava_config("gemma"))


def test_collated_batches_train_as_transformers(one_rank, folders):
    """Samples through the tiny ``LlavaProcessor`` (pictures of other sizes resized and cropped to 28x28) through
    DataCollatorForImageText: logits as transformers' on the padded batch; packed (one row, 2-D positions) as padded;
    LoongTrainer logs transformers.Trainer's three losses with every component trained; both leave the ViT block
    after the feature layer and ``post_layernorm`` as they were, and move the rest of the tower."""
    got, out = one_rank
    collated = got["collated"]
    assert collated["images"] == 3 and collated["image_tokens"] == 48, collated
    assert collated["packed_shape"][0] == 1 and len(collated["positions"]) == 2, collated
    assert collated["padded_diff"] < TOL and collated["packed_diff"] < 1e-5, collated
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)

    def plain(folder):  # NOTE: transformers writes the ViT without ``vision_model`` (transformers 5's naming)
        return {n.replace("vision_tower.vision_model.", "vision_tower."): t for n, t in read_all(folder).items()}

    src = plain(folders["llama"])
    for side in ("hf", "loong"):
        trained = plain(out / "train" / side / "final")
        tower = [n for n in src if n.startswith("vision_tower.")]
        kept = sorted(n for n in tower if torch.equal(src[n], trained[n]))
        assert kept == sorted(n for n in tower if ".layers.2." in n or "post_layernorm" in n), (side, kept)


def test_per_call_vision_feature_overrides_refused():
    """transformers' LLaVA takes ``vision_feature_layer`` / ``vision_feature_select_strategy`` per call; the tower here
    is built for the config's, so a different value is refused (not silently ignored) and the config's own passes."""
    from types import SimpleNamespace

    from loongforge_hf.multimodal.modeling import _refuse_vision_overrides

    config = SimpleNamespace(vision_feature_layer=-2, vision_feature_select_strategy="default")
    _refuse_vision_overrides(config, {"vision_feature_layer": -2, "vision_feature_select_strategy": "default"})
    _refuse_vision_overrides(config, {})
    with pytest.raises(ValueError, match=r"vision_feature_layer=-1 differs from the checkpoint config's -2"):
        _refuse_vision_overrides(config, {"vision_feature_layer": -1})
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy='full' differs"):
        _refuse_vision_overrides(config, {"vision_feature_select_strategy": "full"})
