"""Gemma 3 image-text (``Gemma3ForConditionalGeneration``) against transformers: logits, loss and vision gradients
within 1e-4 (fp32; measured below 1e-5) with each image's tokens attending both ways (``token_type_ids``) and
causally (without them), in each layout of the vision tower and the language model; the three on-disk namings,
bit-exact round trips; ``lf.AutoModelForCausalLM`` loading it as transformers' does; generate; LoongTrainer against
transformers.Trainer; refusals."""

from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_vl import make_tiny_gemma3_vl, tiny_gemma3_vl_config

from ._vl_parity import TWO_RANKS
from ._vl_gemma3 import (TEXT_ROWS, compare_many, generate_both, generate_layouts, make_batch,
                         packed_against_padded, train_both)

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "processor_config.json")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl") / "src")


def check(result: dict, *, grads: bool) -> None:
    assert result["logits_shape"] == (2, 44, 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL, result


def test_parity_and_round_trip_one_rank(checkpoint, tmp_path):
    """TP1 with and without token_type_ids (the image blocks change the logits: checked against the causal run), a
    text-only batch, the hub's and the module namings (each exported under its own names), and
    lf.AutoModelForCausalLM giving the image-text model as transformers' AutoModelForCausalLM does."""
    import transformers

    hub = make_tiny_gemma3_vl(tmp_path / "hub", naming="hub")
    modules = make_tiny_gemma3_vl(tmp_path / "modules", naming="modules")
    text = make_batch(TEXT_ROWS)
    cases = [("tp1", str(checkpoint), {}, str(tmp_path / "tp1"), {}),
             ("causal", str(checkpoint), {}, None, {"batch": make_batch(token_types=False)}),
             ("text_only", str(checkpoint), {}, None, {"batch": text}),
             ("hub", str(hub), {}, str(tmp_path / "hub_out"), {}),
             ("modules", str(modules), {}, str(tmp_path / "modules_out"), {}),
             ("causal_lm_auto", str(checkpoint), {}, None, {"auto_class": "AutoModelForCausalLM"})]
    results = run_distributed(compare_many, 1, cases, timeout=400)[0]
    for name in ("tp1", "causal", "hub", "modules", "causal_lm_auto"):
        check(results[name], grads=True)
    assert results["text_only"]["logit_diff"] < TOL and results["text_only"]["loss_diff"] < TOL
    assert results["causal_lm_auto"]["class"] == "LoongModelForImageTextToText"
    assert type(transformers.AutoModelForCausalLM.from_pretrained(checkpoint)).__name__ == \
        "Gemma3ForConditionalGeneration"
    for src, out in ((checkpoint, "tp1"), (hub, "hub_out"), (modules, "modules_out")):
        _check_round_trip(src, tmp_path / out, side_files=SIDE_FILES)
    assert "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" in read_all(tmp_path / "hub_out")


def test_parity_and_round_trip_two_ranks(checkpoint, tmp_path):
    """TP2 with sequence parallelism and the tower split over TP (q / k / v fused by heads); TP2 with the tower
    encoder-data-parallel and both components recomputed; PP2 (forward; the image blocks on both stages); CP2 (an
    image spans the two chunks of rank 0; gradients summed over the CP ranks)."""
    cases = [(n, str(checkpoint), layout, str(tmp_path / n), {}) for n, layout in TWO_RANKS.items()]
    per_rank = run_distributed(compare_many, 2, cases, timeout=600)
    for results in per_rank:
        for n, layout in TWO_RANKS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
    assert per_rank[0]["tp2_sp_vision_tp2"]["vision_layout"] == "tensor_parallel"
    for n in TWO_RANKS:
        _check_round_trip(checkpoint, tmp_path / n, side_files=SIDE_FILES)


def test_generate_matches_transformers(checkpoint):
    """Greedy with and without the KV cache (image blocks at the prefill / in every uncached step, as transformers)
    and beam search (each row's images copied with it), left-padded prompts with images: the same tokens, logits
    and scores within 1e-4."""
    got = run_distributed(generate_both, 1, str(checkpoint), {}, timeout=400)[0]
    for name, r in got.items():
        assert r["same_sequences"] and r["max_diff"] < TOL and r["steps"] >= 4, (name, r)


GENERATE_LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True,
                               "vision_tensor_parallel_size": 2},
                    "pp2": {"pipeline_parallel_size": 2}, "cp2": {"context_parallel_size": 2}}


def test_generate_matches_transformers_two_ranks(checkpoint):
    """The same scenarios at TP2 + SP with the tower split, PP2 and CP2 (the cached prefill split over the CP ranks,
    an image across its chunks)."""
    per_rank = run_distributed(generate_layouts, 2, str(checkpoint), GENERATE_LAYOUTS, timeout=600)
    for got in per_rank:
        for layout, scenarios in got.items():
            for name, r in scenarios.items():
                assert r["same_sequences"] and r["max_diff"] < TOL and r["steps"] >= 4, (layout, name, r)


# ---- pure pieces ---------------------------------------------------------------------------------------------------

def test_bidirectional_blocks_match_transformers_mask():
    """``kernels.attention.sdpa`` under ``bidirectional_blocks`` equals attention under transformers' Gemma 3 masks
    (``create_masks_for_vision_model``: full and sliding layers) with right padding, also for a CP chunk's queries."""
    from transformers.models.gemma3.modeling_gemma3 import (create_masks_for_vision_model,
                                                            get_block_sequence_ids_for_mask)

    from loongforge_hf.kernels.attention import bidirectional_blocks, sdpa
    from loongforge_hf.multimodal.chunk import image_blocks

    config = tiny_gemma3_vl_config(sliding_window=5).text_config
    config._attn_implementation = "sdpa"
    types = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]])
    pad = torch.ones_like(types)
    pad[1, -2:] = 0
    q, k, v = torch.randn(2, 4, 14, 8), torch.randn(2, 2, 14, 8), torch.randn(2, 2, 14, 8)
    masks = create_masks_for_vision_model(config, torch.zeros(2, 14, 8), pad, None, torch.arange(14)[None],
                                          get_block_sequence_ids_for_mask(types))
    ours_pad = ~pad.bool()[:, None, None, :] | torch.triu(torch.ones(14, 14, dtype=torch.bool), 1)
    for kind, window in (("full_attention", None), ("sliding_attention", (4, 0))):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=masks[kind], enable_gqa=True)
        with bidirectional_blocks(image_blocks(types)):
            got = sdpa(q, k, v, causal=True, scale=8 ** -0.5, window=window, mask=ours_pad)
            chunk = sdpa(q[:, :, 3:7], k, v, causal=True, scale=8 ** -0.5, window=window, mask=ours_pad[..., 3:7, :],
                         q_offset=3)
        rows = pad.bool()[:, None, :, None].expand_as(want)
        assert torch.allclose(got[rows], want[rows], atol=1e-6), kind
        assert torch.allclose(chunk, got[:, :, 3:7], atol=1e-6), kind


def test_bad_configs_are_refused(checkpoint, tmp_path):
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.gemma3_vl import Gemma3VLBridge

    for change, message in (({"vision_use_head": True}, "vision_use_head=True is not supported"),
                            ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported")):
        config = tiny_gemma3_vl_config()
        for k, value in change.items():
            setattr(config.vision_config, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            Gemma3VLBridge(config)
    config = tiny_gemma3_vl_config()
    config.mm_tokens_per_image = 9
    with pytest.raises(UnsupportedConfigError, match="must be a square whose side divides"):
        Gemma3VLBridge(config)
    config = tiny_gemma3_vl_config()
    config.tie_word_embeddings = False
    with pytest.raises(UnsupportedConfigError, match="tie_word_embeddings=False"):
        Gemma3VLBridge(config)


def test_processor_batches_train_as_transformers(checkpoint, tmp_path):
    """Gemma3Processor's samples through DataCollatorForImageText: padded logits as transformers'; packed (one row,
    2-D positions) as padded; LoongTrainer (ViT frozen) logs transformers.Trainer's three losses, and the frozen
    ViT comes out of save_model bit for bit while the projector moved."""
    got = run_distributed(_processor_and_training, 1, str(checkpoint), str(tmp_path), timeout=400)[0]
    packed = got["packed"]
    assert packed["packed_shape"][0] == 1 and len(packed["positions"]) == 2 and packed["token_types"] == 32, packed
    assert packed["padded_diff"] < TOL and packed["packed_diff"] < 1e-5, packed
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    src, out = read_all(checkpoint), read_all(tmp_path / "loong" / "final")
    moved = sorted(n for n in src if not torch.equal(src[n], out[n]))
    assert all(not n.startswith("vision_tower.") for n in moved), moved
    assert any(n.startswith("multi_modal_projector.") for n in moved), moved


def _processor_and_training(folder, out_dir):
    return {"packed": packed_against_padded(folder), **train_both(folder, out_dir)}


TEXT_SFT = ["full_packing", "full_prompt_completion", "lora_neftune"]


def test_text_sft_through_causal_lm_matches_trl(checkpoint, tmp_path):
    """Text-only fine-tuning of the image-text checkpoint as users run it on gemma-3-4b-it: ``lf.AutoModelForCausalLM``
    + LoongSFTTrainer at TP2 with sequence parallelism against ``transformers.AutoModelForCausalLM`` (which gives
    ``Gemma3ForConditionalGeneration`` too) + trl.SFTTrainer: full fine-tuning packed and prompt/completion, LoRA on
    q / v with NEFTune; losses and token metrics within tests/integrations/test_sft.py's tolerances."""
    from tests.integrations._sft_parity import assert_matches, run_loong, run_trl

    trl_runs = run_distributed(run_trl, 1, str(checkpoint), str(tmp_path / "trl"), TEXT_SFT, timeout=400)[0]
    ranks = run_distributed(run_loong, 2, str(checkpoint), str(tmp_path / "tp2"),
                            {"tensor_parallel_size": 2, "sequence_parallel": True}, TEXT_SFT, timeout=400)
    for name in TEXT_SFT:
        assert ranks[1][name]["losses"] == ranks[0][name]["losses"], name
        assert_matches(name, trl_runs[name], ranks[0][name])
