"""Rank functions for tests/multimodal/test_llava_onevision.py (module-level so spawned ranks can import them), compared
with transformers: ``"pictures"``, three pictures of three sizes through the tiny LLaVA-OneVision inputs (2 crops,
nothing unpadded; 3 crops, unpadded; 5 crops, unpadded and shrunk by ``anyres_max_2``); ``"video"``, a 2-frame video
beside a picture; ``"multi"``, a sample of two pictures (base crops only) beside a sample of one; ``"collated"``, a
video sample, a two-picture sample and a one-picture sample, each through the processor alone, batched by
``DataCollatorForImageText``."""

from __future__ import annotations

from loongforge_hf.testing.tiny_llava import IMAGE
from loongforge_hf.testing.tiny_llava_onevision import VIDEO, llava_onevision_inputs

# (texts, picture sizes, frames a video) of each batch
BATCHES = {"pictures": (["tok5 <image> tok7 tok8", "tok9 <image> tok10",
                         "tok3 <image> " + " ".join(f"tok{i}" for i in range(13, 20))],
                        [(20, 20), (20, 40), (50, 36)], 0),
           "video": (["tok5 <video> tok7 tok8 tok9", "tok9 <image> tok10"], [(20, 40)], 2),
           "multi": (["tok3 <image> tok4 <image> tok6", "tok9 <image> tok10 tok11"], [(20, 40), (50, 36), (20, 20)],
                     0)}

# (text, picture sizes, frames a video) of each sample collated
SAMPLES = [("tok5 <video> tok7 tok8 tok9", [], 2), ("tok3 <image> tok4 <image> tok6", [(20, 40), (50, 36)], 0),
           ("tok9 <image> tok10 tok11", [(20, 20)], 0)]


def collated_batch(folder: str) -> dict:
    """``SAMPLES``, each through the processor alone (its leading batch dimension kept, as ``return_tensors="pt"``
    gives it), collated by ``DataCollatorForImageText.from_processor`` (the config's branch: the processor itself
    needs torchvision) padded to a multiple of 4."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_llava_onevision import tiny_llava_onevision_config

    features = [llava_onevision_inputs(folder, [text], sizes, seed=k, frames=frames)
                for k, (text, sizes, frames) in enumerate(SAMPLES)]
    processor = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(folder), image_token_id=IMAGE,
                                video_token_id=VIDEO)
    collator = DataCollatorForImageText.from_processor(processor, tiny_llava_onevision_config(), pad_to_multiple_of=4)
    return collator(features)


def make_batch(folder: str, name: str = "pictures") -> dict:
    if name == "collated":
        return collated_batch(folder)
    texts, sizes, frames = BATCHES[name]
    batch = llava_onevision_inputs(folder, texts, sizes, seed=1, pad_to_multiple_of=4, frames=frames)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return {**batch, "labels": ids.masked_fill((mask == 0) | (ids == IMAGE) | (ids == VIDEO), -100)}


def checks(*, cases: list, generation: tuple | None = None) -> dict:
    """``_vl_gemma3.compare`` (logits, loss, vision gradients, ``image_newline``'s included; the export where
    ``out_dir`` is given) for each (name, folder, layout, out_dir, batch name) of ``cases``, on ``make_batch``; with
    ``generation`` (folder, scenarios), ``generate`` as ``out["generate"]``."""
    from ._vl_gemma3 import compare

    out = {} if generation is None else {"generate": generate(folder=generation[0], layout={},
                                                              scenarios=generation[1])}
    for name, folder, layout, out_dir, batch_name in cases:
        batch = make_batch(folder, batch_name)
        out[name] = {**compare(folder, layout, out_dir, batch=batch),
                     "image_tokens": (batch["input_ids"] == IMAGE).sum(-1).tolist(),
                     "video_tokens": (batch["input_ids"] == VIDEO).sum(-1).tolist()}
    return out


def generate(*, folder: str, layout: dict, scenarios: dict) -> dict:
    """``_vl_gemma3.generate_both`` on the ``"video"`` batch's prompts, left-padded, per scenario."""
    from ._vl_gemma3 import generate_both

    def prompts() -> dict:
        texts, sizes, frames = BATCHES["video"]
        return llava_onevision_inputs(folder, texts, sizes, seed=1, padding_side="left", frames=frames)

    return generate_both(folder, layout, prompts=prompts, scenarios=scenarios)
