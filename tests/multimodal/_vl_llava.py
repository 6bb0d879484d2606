"""Rank functions for tests/multimodal/test_llava.py and test_llava_lora.py (module-level so spawned ranks can import
them) and the transformers reference they are compared with: hand-built LLaVA batches (16 ``<image>`` tokens per
28x28 image), random images; samples through the tiny ``LlavaProcessor`` for the collator and training."""

from __future__ import annotations

from loongforge_hf.testing.tiny_llava import IMAGE, llava_image_prompt

from ._vl_gemma3_lora import CONFIGS

# two rows of 40 tokens: three images (one spans the CP2 chunks' boundary), the first row padded by one token
ROWS = [[5, 6, -1, 7, 8, 9, -1, 10, 11, 0], [12, -1] + list(range(13, 36))]
TEXT_ROWS = [list(range(5, 25)), list(range(30, 50))]


def make_batch(rows=ROWS, *, seed: int = 1) -> dict:
    """input_ids, attention_mask (0 on the pad id 0), labels (-100 there and on ``<image>``), pixel_values
    ``[n, 3, 28, 28]``."""
    batch = llava_image_prompt(rows, seed=seed)
    ids = batch["input_ids"]
    mask = (ids != 0).long()  # NOTE: id 0 is the pad token; the rows' text ids start at 5
    return {**batch, "attention_mask": mask, "labels": ids.masked_fill((mask == 0) | (ids == IMAGE), -100)}


def compare(folder: str, layout: dict, out_dir: str | None = None, *, batch: dict | None = None) -> dict:
    """``_vl_gemma3.compare`` on this file's batches."""
    from ._vl_gemma3 import compare as compare_with

    return compare_with(folder, layout, out_dir, batch=batch, batch_for=make_batch)


def prompts() -> dict:
    """A left-padded prompt batch: a row with two images, a row with one, as ``generate`` takes them."""
    batch = llava_image_prompt([[5, -1, 6, 7, -1, 8], [0] * 16 + [9, 10, -1, 11, 12]], seed=4)
    return {**batch, "attention_mask": (batch["input_ids"] != 0).long()}


def checks(*, cases: list, folder: str, generate: dict, lora: dict, folders: dict, out_dir: str,
           train: bool = False) -> dict:
    """Everything one world checks, so each world size is one launch: ``compare`` for each (name, folder, layout,
    out_dir, extra keywords) of ``cases``; ``_vl_gemma3.generate_both`` (greedy, uncached, beams) of ``folder`` on
    ``prompts()`` under each of ``generate``; ``lora_checks`` of ``lora`` (``LORA_CASES``' form) on ``folders``; with
    ``train``, ``collate_and_train`` of ``folder``."""
    from ._vl_gemma3 import SCENARIOS, generate_both

    out = {"parity": {name: compare(f, layout, o, **extra) for name, f, layout, o, extra in cases},
           "generate": {name: generate_both(folder, layout, prompts, SCENARIOS) for name, layout in generate.items()},
           "lora": lora_checks(lora, folders, f"{out_dir}/lora")}
    if train:
        out.update(collate_and_train(folder, f"{out_dir}/train"))
    return out


# ---- the processor, the collator, training ---------------------------------------------------------------------------

# per sample: its text and, where it has "<image>", a picture's (height, width) in pixels (resized and cropped to 28)
TRAIN_SAMPLES = [(f"tok{5 + i} <image> tok{30 + i} tok{40 + i}", (40, 90) if i % 2 else (50, 36))
                 for i in range(4)] + [(f"tok{60 + i} tok{70 + i} tok{80 + i}", None) for i in range(4)]


def train_features(folder: str) -> list:
    """Each sample through the tiny ``LlavaProcessor`` (``tiny_llava.llava_processor_for``)."""
    import numpy as np

    from loongforge_hf.testing.tiny_llava import llava_processor_for

    processor = llava_processor_for(folder)
    rng = np.random.RandomState(5)
    return [dict(processor(text=[text], images=[rng.randint(0, 256, (*size, 3), dtype=np.uint8)] if size else None,
                           return_tensors="pt")) for text, size in TRAIN_SAMPLES]


def collated_against_transformers(folder: str) -> dict:
    """The processor's samples collated padded and packed (one row, 2-D positions restarting per sample): ours
    against transformers' on the padded batch, packed against padded at every real token."""
    from loongforge_hf.testing.tiny_llava import llava_processor_for

    from ._vl_parity import collated_logits

    features = train_features(folder)[:3] + train_features(folder)[5:6]
    padded, packed, out = collated_logits(folder, llava_processor_for(folder), features)
    return {"images": padded["pixel_values"].shape[0], "image_tokens": int((padded["input_ids"] == IMAGE).sum()),
            **out}


def train(folder: str, out_dir: str, *, loong: bool) -> list:
    """Three steps of batches of 2, every component trained: the logged losses."""
    from loongforge_hf.testing.tiny_llava import llava_processor_for

    from ._vl_parity import trained_losses

    return trained_losses(folder, out_dir, loong=loong, processor=llava_processor_for(folder),
                          features=train_features(folder))


def collate_and_train(folder: str, out_dir: str) -> dict:
    return {"collated": collated_against_transformers(folder), "hf": train(folder, out_dir + "/hf", loong=False),
            "loong": train(folder, out_dir + "/loong", loong=True)}


# ---- LoRA against PEFT ---------------------------------------------------------------------------------------------

# NOTE: Gemma 3's two configs ("qv": the language model's and the tower's q / v, rsLoRA; "all_linear" with a language
# norm trained whole): PEFT matches the same names on every tower
LORA_CONFIGS = CONFIGS
SPLIT_SP = {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2, "sequence_parallel": True}
# NOTE: LoRA on LLaVA's and LLaVA-NeXT's tiny models: adapted linears with a gradient (CLIP's and the projector's,
# the language model's: 4 layers), those of ViT block 2 (no gradient), the tensors trained whole
LORA_TARGETS = {"qv": (2 * 2, 4 * 2), "all_linear": (2 * 6 + 2, 4 * 7)}
LORA_IDLE = {"qv": 2, "all_linear": 6}
LORA_SAVED = {"qv": 0, "all_linear": 4}
# ranks -> case -> (checkpoint: "llama" or "qwen2", layout, configs)
LORA_CASES = {1: {"tp1": ("llama", {}, ("qv", "all_linear"))},
              2: {"tp2_split_sp": ("llama", SPLIT_SP, ("all_linear",)),
                  "qwen2_tp2_split_sp": ("qwen2", SPLIT_SP, ("qv",))}}


def lora_checks(cases: dict, folders: dict, out_dir: str) -> dict:
    """``_vl_lora.model_checks`` (logits, loss, adapter gradients, PEFT's counts, adapter and merged files) of each
    case (name -> (checkpoint key, layout, configs)) on ``make_batch()``; ``folders``: the checkpoint of each key."""
    from . import _vl_lora as V

    return {f"{case}/{name}": V.model_checks(folders[key], f"{out_dir}/{case}-{name}", layout, name, LORA_CONFIGS,
                                             batch_for=lambda _: make_batch(), grad_tol=5e-5)
            for case, (key, layout, names) in cases.items() for name in names}
