"""Rank functions for tests/multimodal/test_gemma4_vl.py (module-level so spawned ranks can import them): Gemma 4 as
the hub publishes it (``Gemma4ForConditionalGeneration``) on text-only and image batches against transformers' own
class."""

from __future__ import annotations

import torch

from loongforge_hf.testing.tiny_gemma4_vl import SPECIAL, TEXT_VOCAB


def text_batch(seed: int = 7) -> dict:
    """Two rows of 12 text ids (no placeholder), the second right-padded by 4; labels -100 on padding."""
    ids = torch.randint(4, TEXT_VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def compare(folder: str, layout: dict, out_dir: str, *, auto_class: str = "AutoModelForCausalLM") -> dict:
    """Logits (real tokens), loss and ``logits_to_keep`` against transformers' on ``text_batch()``; the model
    exported to ``out_dir``."""
    import transformers

    import loongforge_hf as lf

    batch = text_batch()
    model = getattr(lf, auto_class).from_pretrained(folder, dtype=torch.float32, **layout)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        out, want = model(**batch), ref(**batch)
        kept = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=3).logits
    valid = batch["attention_mask"].bool()
    model.save_pretrained(out_dir, max_shard_size="60KB")
    return {"class": type(model).__name__, "ref_class": type(ref).__name__,
            "logit_diff": (out.logits - want.logits).abs()[valid].max().item(),
            "loss_diff": abs(out.loss.item() - want.loss.item()),
            "keep_diff": (kept - out.logits[:, -3:]).abs().max().item(), "tower": model.vision_tower}


def refusals(folder: str) -> dict:
    """The error each refused input gives (``type: message``), forward and generate."""
    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    ids = text_batch()["input_ids"]
    placeholder = ids.clone()
    placeholder[0, 3] = SPECIAL["audio_token_id"]
    image_placeholder = ids.clone()
    image_placeholder[0, 3] = SPECIAL["image_token_id"]
    cases = {"pixel_values": {"pixel_values": torch.zeros(1, 4, 768)},
             "pixel_values_videos": {"pixel_values_videos": torch.zeros(1, 4, 768)},
             "input_features": {"input_features": torch.zeros(1, 16, 128),
                                "input_features_mask": torch.ones(1, 16, dtype=torch.bool)},
             "placeholder": {"input_ids": placeholder}, "image_placeholder": {"input_ids": image_placeholder}}
    out = {}
    for name, extra in cases.items():
        for how in ("forward", "generate"):
            try:
                inputs = {"input_ids": ids, **extra}
                model(**inputs) if how == "forward" else model.generate(**inputs, max_new_tokens=2)
                out[f"{how}/{name}"] = "no error"
            except Exception as error:  # noqa: BLE001 - reported to the test
                out[f"{how}/{name}"] = f"{type(error).__name__}: {error}"
    return out


def generate_both(folder: str) -> dict:
    """Greedy generate (KV cache) of a left-padded text batch: sequences equal, largest logit difference."""
    import transformers

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(4, TEXT_VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=0)
    got, want = model.generate(**kw), ref.generate(**kw)
    return {"same": torch.equal(got.sequences, want.sequences),
            "diff": max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))}


def train(folder: str, out_dir: str, *, loong: bool) -> list:
    """Three steps of text-only batches of 2 (LoongTrainer on ``lf.AutoModelForCausalLM``'s model, or
    transformers.Trainer on transformers'): the logged losses; the model saved under ``out_dir/final``."""
    import transformers

    import loongforge_hf as lf

    from ._vl_parity import vl_training_args

    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(4, TEXT_VOCAB, (10,), generator=g) for _ in range(6)]
    features = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in rows]
    args = vl_training_args(out_dir)
    if loong:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = lf.LoongTrainer(model=model, args=args, train_dataset=features,
                                  data_collator=transformers.default_data_collator)
    else:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=features,
                                       data_collator=transformers.default_data_collator)
    trainer.train()
    trainer.save_model(out_dir + "/final")
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def one_rank(folder: str, no_audio: str, out_dir: str, small: str) -> dict:
    """Everything the one-rank world checks (see the test module)."""
    from tests.bridges._gradients import gradient_checks

    return {"small_images": compare_images(small, {}, f"{out_dir}/small_images"),
            "small_image_generate": generate_images(small),
            "tp1": compare(folder, {}, f"{out_dir}/tp1"),
            "image_text": compare(folder, {}, f"{out_dir}/image_text", auto_class="AutoModelForImageTextToText"),
            "no_audio": compare(no_audio, {}, f"{out_dir}/no_audio"),
            "grads": gradient_checks([("tp1", folder, {}, False)]).get("tp1"),
            "refusals": refusals(folder), "generate": generate_both(folder),
            "images": compare_images(folder, {}, f"{out_dir}/images", grads=True),
            "image_generate": generate_images(folder),
            "train": {"hf": train(folder, f"{out_dir}/hf", loong=False),
                      "loong": train(folder, f"{out_dir}/loong", loong=True)}}


def two_ranks(folder: str, out_dir: str, layouts: dict, small: str) -> dict:
    cp2 = {"context_parallel_size": 2}
    return {**{name: compare(folder, layout, f"{out_dir}/{name}") for name, layout in layouts.items()},
            "images_tp2_sp": compare_images(folder, layouts["tp2_sp"], f"{out_dir}/images_tp2_sp"),
            "images_cp2": compare_images(folder, cp2, f"{out_dir}/images_cp2", grads=True, batch=cp_image_batch()),
            "small_images_cp2": compare_images(small, cp2, f"{out_dir}/small_images_cp2", grads=True,
                                               batch=cp_image_batch())}


def cp_image_batch() -> dict:
    """``image_batch()`` right-padded to 16 tokens (a multiple of 2 x CP2): its images' blocks cross the chunks of
    both CP ranks (the second row's ``boi`` and soft tokens at 1-5: chunk 0 on rank 0, chunk 1 on rank 1)."""
    batch = image_batch()
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100, "mm_token_type_ids": 0}
    return {k: torch.nn.functional.pad(v, (0, 2), value=fill[k]) if k in fill else v for k, v in batch.items()}


# ---- images --------------------------------------------------------------------------------------------------------

# the two images' patch grids (h, w): 2 and 4 soft tokens after the 3x3 pooling; the first padded to the second's 36
GRIDS = ((3, 6), (6, 6))


def image_batch(seed: int = 5) -> dict:
    """Two rows of 14 ids, each with one image (``boi``, its soft tokens, ``eoi``), the first right-padded by 3;
    ``pixel_values [2, 36, 768]`` and ``image_position_ids`` as Gemma 4's processor gives them (row-major, x
    fastest, (-1, -1) padding after), ``mm_token_type_ids`` 1 on the image tokens; labels -100 there and on padding."""
    g = torch.Generator().manual_seed(seed)
    most = max(h * w for h, w in GRIDS)
    pixels, positions = torch.rand(len(GRIDS), most, 768, generator=g), torch.full((len(GRIDS), most, 2), -1)
    for i, (h, w) in enumerate(GRIDS):
        positions[i, :h * w] = torch.stack([torch.arange(w).repeat(h), torch.arange(h).repeat_interleave(w)], -1)
        pixels[i, h * w:] = 0.0
    text = torch.randint(4, TEXT_VOCAB, (2, 14), generator=g)
    ids, types, mask = text.clone(), torch.zeros_like(text), torch.ones_like(text)
    for row, ((h, w), start) in enumerate(zip(GRIDS, (3, 1))):
        n = h * w // 9
        ids[row, start] = SPECIAL["boi_token_id"]
        ids[row, start + 1:start + 1 + n] = SPECIAL["image_token_id"]
        types[row, start + 1:start + 1 + n] = 1
        ids[row, start + 1 + n] = SPECIAL["eoi_token_id"]
    mask[0, -3:] = 0
    ids[0, -3:] = 0
    labels = ids.masked_fill((mask == 0) | (types == 1), -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels,
            "image_position_ids": positions, "mm_token_type_ids": types}


def compare_images(folder: str, layout: dict, out_dir: str | None = None, *, grads: bool = False,
                   batch: dict | None = None) -> dict:
    """Logits (real tokens) and loss against transformers' on ``image_batch()``; with ``grads`` the vision tower's
    and embedder's gradients too (HF names); the model exported to ``out_dir``."""
    import transformers

    import loongforge_hf as lf

    from ._vl_parity import vision_grads

    batch = batch if batch is not None else image_batch()
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    want = ref(**batch)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = model(**batch)
    valid = batch["attention_mask"].bool()
    result = {"logit_diff": (out.logits - want.logits).abs()[valid].max().item(),
              "loss_diff": abs(out.loss.item() - want.loss.item()),
              # NOTE: the same batch without mm_token_type_ids (causal everywhere): the blocks matter
              "blocks_matter": (ref(**{k: v for k, v in batch.items() if k != "mm_token_type_ids"}).logits
                                - want.logits).abs()[valid].max().item()}
    if grads:
        want.loss.backward()
        out.loss.backward()
        if model.parallel.context_parallel_size > 1:  # NOTE: each CP rank's share of the loss, summed as DDP does
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
        theirs = {n: p.grad for n, p in ref.named_parameters()
                  if n.startswith(("model.vision_tower.", "model.embed_vision.")) and p.grad is not None}
        ours = vision_grads(model, rename=lambda name: name)
        result["grad_names"] = sorted(set(ours) ^ set(theirs))
        result["grad_diff"] = max((ours[n] - theirs[n]).abs().max().item() for n in theirs)
        result["grads"] = len(theirs)
    if out_dir is not None:
        model.save_pretrained(out_dir, max_shard_size="60KB")
    return result


def generate_images(folder: str) -> dict:
    """Greedy generate (KV cache) of ``image_batch()``'s rows as left-padded prompts, against transformers':
    sequences equal, largest logit difference."""
    import transformers

    import loongforge_hf as lf

    batch = image_batch()
    prompts = {k: batch[k].clone() for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    for k in prompts:  # NOTE: the first row's padding moved to its start
        prompts[k][0] = prompts[k][0].roll(3)
    prompts.update(pixel_values=batch["pixel_values"], image_position_ids=batch["image_position_ids"])
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    got, want = model.generate(**prompts, **kw), ref.generate(**prompts, **kw)
    return {"same": torch.equal(got.sequences, want.sequences),
            "diff": max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))}
