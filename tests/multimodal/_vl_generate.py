"""Rank functions for tests/multimodal/test_qwen2_5_vl_generate.py and test_qwen3_vl_generate.py (module-level so
spawned ranks can import them), and the transformers reference they are compared with; either checkpoint (its
processor, its patch size, its video layout: ``_vl_features.hand_features``)."""

from __future__ import annotations

import numpy as np
import torch

from tests._generation import _plain, refusals, step_lengths

# a left-padded batch: two prompts with images of different sizes (6 and 2 merged tokens) and a text-only one; image
# sizes in patches (56 x 84 and 28 x 56 pixels with Qwen2.5-VL's 14-pixel patches, 64 x 96 and 32 x 64 with
# Qwen3-VL's 16)
PROMPTS = [("tok5 tok6 <|vision_start|><|image_pad|><|vision_end|> tok7 tok8 tok9", [(4, 6)]),
           ("<|vision_start|><|image_pad|><|vision_end|> tok10", [(2, 4)]),
           ("tok20 tok21 tok22 tok23", [])]
TEXT_ONLY = [("tok30 tok31", []), ("tok40 tok41 tok42 tok43 tok44", [])]
NEW_TOKENS = 6
SCENARIOS = {
    "greedy": dict(max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_scores=True, output_logits=True),
    "sample": dict(max_new_tokens=4, do_sample=True, top_k=20, temperature=0.8, return_dict_in_generate=True,
                   output_logits=True),
}
# each row expanded before the prefill (its images with it): beam search and several samples per prompt
EXPANDED = {
    "beam": dict(max_new_tokens=4, num_beams=3, num_return_sequences=2, return_dict_in_generate=True,
                 output_scores=True),
    "sample": dict(max_new_tokens=4, do_sample=True, top_k=20, temperature=0.8, num_return_sequences=2,
                   return_dict_in_generate=True, output_logits=True),
}
SEED = 3


def prompt_batch(folder: str, prompts=PROMPTS, seed: int = 3) -> dict:
    """The checkpoint's processor's left-padded batch (input_ids, attention_mask, mm_token_type_ids, pixel_values,
    image_grid_thw)."""
    from loongforge_hf.testing.tiny_vl import processor_for

    processor = processor_for(folder)
    processor.tokenizer.padding_side = "left"
    patch = processor.image_processor.patch_size
    rng = np.random.RandomState(seed)
    images = [rng.randint(0, 256, (h * patch, w * patch, 3), dtype=np.uint8) for _, sizes in prompts
              for h, w in sizes]
    return dict(processor(text=[t for t, _ in prompts], images=images or None, padding=True, return_tensors="pt"))


def video_batch(folder: str) -> dict:
    """A left-padded batch with videos (Qwen2.5-VL: ``second_per_grid_ts`` 1.5 s and 0.5 s; Qwen3-VL: each frame
    after its timestamp, none), an image and a text-only row, built by hand (transformers' video processor needs
    torchvision) and collated."""
    from ._vl_features import collator, hand_features

    batch = collator(folder, padding_side="left")(hand_features(folder))
    return {k: v for k, v in batch.items() if k != "labels"}


def run_scenarios(model, inputs: dict, scenarios: dict = SCENARIOS, **extra) -> dict:
    import transformers

    got = {}
    for name, kw in scenarios.items():
        transformers.set_seed(SEED)
        got[name] = _plain(model.generate(**inputs, **kw, **extra))
    return got


def transformers_reference(folder: str) -> dict:
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return {"images": run_scenarios(model, prompt_batch(folder)),
            "text_only": run_scenarios(model, prompt_batch(folder, TEXT_ONLY), {"greedy": SCENARIOS["greedy"]}),
            "videos": run_scenarios(model, video_batch(folder), {"greedy": SCENARIOS["greedy"]}),
            "images_expanded": run_scenarios(model, prompt_batch(folder), EXPANDED),
            "videos_expanded": run_scenarios(model, video_batch(folder), EXPANDED)}


REFUSED = {"position_ids_4d": lambda inputs: {
               "position_ids": torch.zeros(4, *inputs["input_ids"].shape, dtype=torch.long)},
           "inputs_embeds": lambda inputs: {"inputs_embeds": torch.zeros(*inputs["input_ids"].shape, 64)}}
STATIC = {"cache_implementation": "static"}


def generate_run(folder: str, layout: dict, expanded: bool) -> dict:
    """This rank's outputs with the KV cache and without, the step lengths of each, and the refusals; with
    ``expanded``, the ``EXPANDED`` scenarios too (images and videos batches, cached and uncached)."""
    import torch.distributed as dist

    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    inputs = prompt_batch(folder)
    text_only = prompt_batch(folder, TEXT_ONLY)
    patches = []  # NOTE: the patch rows of each tower forward on this rank (the CP / TP shares; none off stage 0)
    tower = model.vision_tower
    hook = tower.register_forward_pre_hook(lambda module, args: patches.append(int(args[0].shape[0]))) \
        if tower is not None else None
    model.generate(**inputs, max_new_tokens=2, use_cache=False)  # NOTE: two whole steps, each encoding the images
    whole_steps = list(patches)
    patches.clear()
    model.generate(**inputs, max_new_tokens=2, num_beams=3)  # NOTE: the prefill encodes the images
    if hook is not None:
        hook.remove()
    # NOTE: steps are padded for sequence parallelism only (whole on every CP rank)
    res = {"multiple": model.parallel.whole_sequence_multiple,
           "prefill_multiple": model.parallel.sequence_multiple if model.parallel.context_parallel_size > 1
           else model.parallel.whole_sequence_multiple,
           "prompt": inputs["input_ids"].shape[1], "patches": whole_steps, "beam_patches": patches,
           "all_patches": int(inputs["image_grid_thw"].prod(-1).sum()),
           "cached": run_scenarios(model, inputs),
           "static": run_scenarios(model, inputs, **STATIC),
           "uncached": run_scenarios(model, inputs, use_cache=False),
           "text_only": run_scenarios(model, text_only, {"greedy": SCENARIOS["greedy"]}),
           "videos": run_scenarios(model, video_batch(folder), {"greedy": SCENARIOS["greedy"]}),
           "videos_static": run_scenarios(model, video_batch(folder), {"greedy": SCENARIOS["greedy"]}, **STATIC),
           "videos_uncached": run_scenarios(model, video_batch(folder), {"greedy": SCENARIOS["greedy"]},
                                            use_cache=False)}
    if expanded:
        res["batch"] = {"images": inputs["input_ids"].shape[0], "videos": video_batch(folder)["input_ids"].shape[0]}
        for batch, name in ((inputs, "images"), (video_batch(folder), "videos")):
            res[f"{name}_expanded"] = run_scenarios(model, batch, EXPANDED)
            res[f"{name}_expanded_static"] = run_scenarios(model, batch, EXPANDED, **STATIC)
            res[f"{name}_expanded_uncached"] = run_scenarios(model, batch, EXPANDED, use_cache=False)
    greedy = dict(max_new_tokens=4)
    static = model.generate(**inputs, **greedy, **STATIC, return_dict_in_generate=True).cache
    res["static_fixed_steps"] = static.fixed_steps
    del static
    res["lengths"] = {"cached": step_lengths(model, lambda: model.generate(**inputs, **greedy)),
                      "static": step_lengths(model, lambda: model.generate(**inputs, **greedy, **STATIC)),
                      "uncached": step_lengths(model, lambda: model.generate(**inputs, **greedy, use_cache=False))}
    res["refused"] = refusals(model, inputs, REFUSED)
    if dist.get_world_size() > 1:
        changed = dict(inputs, pixel_values=inputs["pixel_values"] + dist.get_rank())
        try:
            model.generate(**changed, max_new_tokens=2)
            res["mismatch"] = None
        except Exception as err:  # noqa: BLE001
            res["mismatch"] = (type(err).__name__, str(err))
    return res


def generate_many(folder: str, layouts: list) -> dict:
    """``generate_run`` for several (name, layout, expanded) in one world (groups rebuilt for each: one process
    start)."""
    return {name: generate_run(folder, layout, expanded) for name, layout, expanded in layouts}
