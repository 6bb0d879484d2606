"""Rank functions for tests/multimodal/test_llava_next.py (module-level so spawned ranks can import them) and the
transformers reference they are compared with: batches through the tiny ``LlavaNextProcessor`` with pictures of
different sizes and aspect ratios, so each image takes its own number of crops and ``<image>`` tokens."""

from __future__ import annotations

from loongforge_hf.testing.tiny_llava import IMAGE
from loongforge_hf.testing.tiny_llava_next import llava_next_inputs, llava_next_processor_for

# two rows: a wide 40x90 picture (4 crops, 60 tokens) and a tall 50x36 one (5 crops, 72 tokens) in the first, a
# 20x40 one (3 crops, 52 tokens) in the second, which is padded; 140 tokens (a multiple of 4, for CP2)
TEXTS = ["tok5 tok6 <image> tok7 tok8 tok9 <image> tok10 tok11",
         "tok12 <image> " + " ".join(f"tok{i}" for i in range(13, 36))]
SIZES = [(40, 90), (50, 36), (20, 40)]
TEXT_ONLY = ["tok5 tok6 tok7 tok8 tok9 tok10", "tok30 tok31 tok32"]


def make_batch(folder: str, texts=TEXTS, sizes=SIZES, *, seed: int = 1) -> dict:
    """The processor's ``input_ids``, ``attention_mask``, ``pixel_values [n, crops, 3, 28, 28]``, ``image_sizes``,
    padded to a multiple of 4 tokens; labels -100 on padding and ``<image>``."""
    batch = llava_next_inputs(folder, texts, sizes, seed=seed, pad_to_multiple_of=4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return {**batch, "labels": ids.masked_fill((mask == 0) | (ids == IMAGE), -100)}


def compare(folder: str, layout: dict, out_dir: str | None = None, *, text_only: bool = False) -> dict:
    """``_vl_gemma3.compare`` (logits, loss, vision gradients, ``image_newline``'s included) on ``make_batch``."""
    from ._vl_gemma3 import compare as compare_with

    batch = make_batch(folder, TEXT_ONLY, []) if text_only else make_batch(folder)
    return {**compare_with(folder, layout, out_dir, batch=batch),
            "image_tokens": (batch["input_ids"] == IMAGE).sum(-1).tolist()}


def prompts(folder: str) -> dict:
    """A left-padded prompt batch: a row with two pictures, a row with one, as ``generate`` takes them."""
    return llava_next_inputs(folder, ["tok5 <image> tok6 tok7 <image> tok8", "tok9 tok10 <image> tok11 tok12"],
                             [(30, 70), (56, 40), (20, 40)], seed=4, padding_side="left")


def checks(*, cases: list, folder: str, generate: dict, out_dir: str, lora: dict, train: bool = False) -> dict:
    """Everything one world checks, so each world size is one launch: ``compare`` for each (name, folder, layout,
    out_dir, extra keywords) of ``cases``; ``_vl_gemma3.generate_both`` (greedy, uncached, beams) of ``folder`` on
    ``prompts`` under each of ``generate``; ``lora_checks`` of ``folder`` under ``lora`` (``LORA_CASES``' form);
    with ``train``, ``collate_and_train`` of ``folder``."""
    from ._vl_gemma3 import SCENARIOS, generate_both

    out = {"parity": {name: compare(f, layout, o, **extra) for name, f, layout, o, extra in cases},
           "generate": {name: generate_both(folder, layout, lambda: prompts(folder), SCENARIOS)
                        for name, layout in generate.items()},
           "lora": lora_checks(lora, folder, f"{out_dir}/lora")}
    if train:
        out.update(collate_and_train(folder, f"{out_dir}/train"))
    return out


# ---- LoRA against PEFT ---------------------------------------------------------------------------------------------

# NOTE: LLaVA's configs (``_vl_gemma3_lora.CONFIGS``: "qv", the language model's and CLIP's q / v, rsLoRA;
# "all_linear", the projector's two linears too, a language norm trained whole); ``image_newline`` stays frozen
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
LORA_CASES = {1: {"tp1": ({}, ("qv", "all_linear"))},  # ranks -> case -> (layout, configs)
              2: {"tp2_split_sp": (SPLIT_SP, ("all_linear",))}}


def lora_checks(cases: dict, folder: str, out_dir: str) -> dict:
    """``_vl_lora.model_checks`` (logits, loss, adapter gradients within 5e-5 of their largest entry, PEFT's counts,
    the adapter folder in PEFT, the merged export in transformers) of each case on ``make_batch``'s any-resolution
    crops."""
    from . import _vl_lora as V
    from ._vl_gemma3_lora import CONFIGS

    return {f"{case}/{name}": V.model_checks(folder, f"{out_dir}/{case}-{name}", layout, name, CONFIGS,
                                             batch_for=make_batch, grad_tol=5e-5)
            for case, (layout, names) in cases.items() for name in names}


# ---- the processor, the collator, training ---------------------------------------------------------------------------

# per sample: its text and, where it has "<image>", a picture's (height, width) in pixels
TRAIN_SAMPLES = [(f"tok{5 + i} <image> tok{30 + i} tok{40 + i}", (40, 90) if i % 2 else (50, 36))
                 for i in range(4)] + [(f"tok{60 + i} tok{70 + i} tok{80 + i}", None) for i in range(4)]


def train_features(folder: str) -> list:
    """Each sample through the tiny ``LlavaNextProcessor`` alone: ``pixel_values [1, crops, 3, 28, 28]``."""
    return [llava_next_inputs(folder, [text], [size] if size else [], seed=5 + i)
            for i, (text, size) in enumerate(TRAIN_SAMPLES)]


def collate_and_train(folder: str, out_dir: str) -> dict:
    """The processor's samples collated padded (crops padded to the most) and packed (one row, 2-D positions): ours
    against transformers' on the padded batch, packed against padded; three steps of batches of 2 with every
    component trained, LoongTrainer against transformers.Trainer (the logged losses)."""
    from ._vl_parity import collated_logits, trained_losses

    features = train_features(folder)
    processor = llava_next_processor_for(folder)
    padded, _, collated = collated_logits(folder, processor, features[:3] + features[5:6])
    out = {"collated": {"pixel_values": tuple(padded["pixel_values"].shape),
                        "image_tokens": int((padded["input_ids"] == IMAGE).sum()), **collated}}
    for side in ("hf", "loong"):
        out[side] = trained_losses(folder, f"{out_dir}/{side}", loong=side == "loong", processor=processor,
                                   features=features)
    return out
