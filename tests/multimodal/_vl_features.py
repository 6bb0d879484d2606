"""Run inside each rank: Qwen2.5-VL with videos, under context parallelism, and with packed samples, against
transformers (or against the same samples unpacked)."""

import torch

from ._vl_parity import train_features, vision_grads, vl_training_args

V_START, V_END, IMAGE, VIDEO = 200, 201, 202, 203
PATCH = 3 * 2 * 14 * 14  # C x temporal patch x patch x patch

# pieces per sample: ("text", "tok5 tok6"), ("image", (t, h, w)), ("video", (t, h, w), seconds per grid)
VIDEO_SAMPLES = [
    [("text", "tok5 tok6"), ("image", (1, 4, 6)), ("text", "tok7"), ("video", (2, 4, 4), 1.5), ("text", "tok8 tok9")],
    [("video", (3, 2, 4), 0.5), ("text", "tok10 tok11 tok12")],
    [("text", "tok20 tok21 tok22 tok23")],
]


def hand_features(folder: str, samples=VIDEO_SAMPLES, seed: int = 7, seconds: bool | None = None) -> list:
    """Processor-like features built by hand (transformers' video processor needs torchvision): token ids from the
    tokenizer, random patches (the checkpoint's patch size), grids, ``mm_token_type_ids``; Qwen2.5-VL's videos take
    ``second_per_grid_ts`` (``seconds``: whether to give them; by default where the vision config has
    ``tokens_per_second``, so not Qwen2-VL's, whose generate refuses them) and one run of placeholders, Qwen2-VL's the
    same, Qwen3-VL's (``qwen3_vl``) none and its processor's layout:
    ``<|vision_start|>``, then per frame a timestamp (two text tokens) and ``<|vision_start|>`` + the frame's
    placeholders + ``<|vision_end|>``, then ``<|vision_end|>``."""
    from transformers import AutoConfig

    from loongforge_hf.testing.tiny_vl import processor_for

    tok = processor_for(folder).tokenizer
    config = AutoConfig.from_pretrained(folder)
    vision, frames_apart = config.vision_config, config.model_type in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")
    seconds = hasattr(vision, "tokens_per_second") if seconds is None else seconds
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2 \
        if frames_apart else PATCH  # NOTE: C x temporal patch x patch x patch
    gen = torch.Generator().manual_seed(seed)
    features = []
    for pieces in samples:
        ids, kinds, f = [], [], {}
        for piece in pieces:
            if piece[0] == "text":
                words = tok.convert_tokens_to_ids(piece[1].split())
                ids += words
                kinds += [0] * len(words)
                continue
            kind, (t, h, w) = piece[0], piece[1]
            n = t * h * w // 4
            token, code = (IMAGE, 1) if kind == "image" else (VIDEO, 2)
            if kind == "video" and frames_apart:
                ids.append(V_START)
                kinds.append(0)
                for frame in range(t):
                    stamp = tok.convert_tokens_to_ids([f"tok{150 + frame}", "tok149"])  # NOTE: "<t seconds>"
                    ids += stamp + [V_START] + [token] * (h * w // 4) + [V_END]
                    kinds += [0] * (len(stamp) + 1) + [code] * (h * w // 4) + [0]
                ids.append(V_END)
                kinds.append(0)
            else:
                ids += [V_START] + [token] * n + [V_END]
                kinds += [0] + [code] * n + [0]
            pixels, grid = ("pixel_values", "image_grid_thw") if kind == "image" else \
                ("pixel_values_videos", "video_grid_thw")
            f[pixels] = torch.cat([f[pixels], torch.randn(t * h * w, patch, generator=gen)]) if pixels in f \
                else torch.randn(t * h * w, patch, generator=gen)
            f[grid] = torch.cat([f.get(grid, torch.zeros(0, 3, dtype=torch.long)), torch.tensor([[t, h, w]])])
            if kind == "video" and not frames_apart and seconds:
                f["second_per_grid_ts"] = torch.cat([f.get("second_per_grid_ts", torch.zeros(0)),
                                                     torch.tensor([piece[2]])])
        f.update(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                 mm_token_type_ids=torch.tensor([kinds]))
        features.append(f)
    return features


def collator(folder: str, **kwargs):
    from transformers import AutoConfig

    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_vl import processor_for

    return DataCollatorForImageText.from_processor(processor_for(folder), AutoConfig.from_pretrained(folder),
                                                   **kwargs)


_REFERENCE: dict = {}


def hf_reference(folder: str, multiple: int):
    """(batch, logits, loss, vision grads) of transformers on the video samples padded to ``multiple``."""
    import transformers

    if (folder, multiple) not in _REFERENCE:
        batch = collator(folder, pad_to_multiple_of=multiple)(hand_features(folder))
        ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        out = ref(**batch)
        out.loss.backward()
        grads = {n[len("model.visual."):]: p.grad for n, p in ref.named_parameters() if n.startswith("model.visual.")}
        _REFERENCE[folder, multiple] = (batch, out.logits.detach(), out.loss.detach(), grads)
    return _REFERENCE[folder, multiple]


def compare_videos(folder: str, layout: dict, multiple: int = 4) -> dict:
    """Logits, loss and vision gradients (summed over the CP group) against transformers."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import loongforge_hf as lf

    batch, ref_logits, ref_loss, ref_grads = hf_reference(folder, multiple)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    calls = {"attention": 0, "vision_attention": 0}
    model.chunks[0].language.decoder.layers[0].self_attention.register_forward_pre_hook(
        lambda *_: calls.__setitem__("attention", calls["attention"] + 1))
    model.vision_tower.blocks[0].attn.register_forward_pre_hook(
        lambda *_: calls.__setitem__("vision_attention", calls["vision_attention"] + 1))
    patches = []  # NOTE: the patch rows each forward of the tower encodes on this rank
    model.vision_tower.register_forward_pre_hook(lambda module, args: patches.append(int(args[0].shape[0])))
    model.train()  # NOTE: as a trainer does (from_pretrained returns eval mode): recomputation acts in training only
    out = model(**batch)
    out.loss.backward()
    grads = vision_grads(model)
    if ps.get_context_parallel_world_size() > 1:
        for g in grads.values():
            dist.all_reduce(g, group=ps.get_context_parallel_group())
    valid = batch["attention_mask"].bool()
    return {"logit_diff": (out.logits - ref_logits).abs()[valid].max().item(),
            "loss_diff": abs(out.loss.item() - ref_loss.item()), "loss": out.loss.item(),
            "grad_diff": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            "same_grad_names": sorted(grads) == sorted(ref_grads), "shape": tuple(out.logits.shape),
            "batch_shape": tuple(batch["input_ids"].shape), "forward_calls": calls, "patches": patches,
            "all_patches": sum(int(g.prod()) for key in ("image_grid_thw", "video_grid_thw") if key in batch
                               for g in batch[key])}


def packing_features(folder: str) -> list:
    return train_features(folder)[:5] + hand_features(folder)


def compare_packed(folder: str, layout: dict) -> dict:
    """The same samples padded and packed (two rows): loss, and each sample's logits."""
    import loongforge_hf as lf

    features = packing_features(folder)
    padded = collator(folder, pad_to_multiple_of=4)(features)
    packed = collator(folder, packing=True, max_length=60, pad_to_multiple_of=4)(features)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    with torch.no_grad():
        a, b = model(**padded), model(**packed)
    diff, row, col = 0.0, 0, 0
    for i, f in enumerate(features):
        n = f["input_ids"].shape[-1]
        if col + n > 60:  # where the collator starts a new row
            row, col = row + 1, 0
        assert packed["position_ids"][0, row, col:col + n].tolist() == list(range(n))
        diff = max(diff, (a.logits[i, :n] - b.logits[row, col:col + n]).abs().max().item())
        col += n
    return {"loss_padded": a.loss.item(), "loss_packed": b.loss.item(), "logit_diff": diff,
            "rows": tuple(packed["input_ids"].shape), "samples": len(features)}


def hf_padded_loss(folder: str) -> float:
    """transformers' loss on the packing samples, padded."""
    import transformers

    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return ref(**collator(folder)(packing_features(folder))).loss.item()


def train_packed(folder: str, out_dir: str) -> dict:
    """3 steps (TP1) on the same samples: LoongTrainer on padded batches, LoongTrainer on packed batches,
    LoongSFTTrainer (a ``datasets.Dataset`` of processor outputs, TRL's preparation skipped) on packed batches."""
    import datasets
    import trl
    from transformers import AutoTokenizer

    import loongforge_hf as lf

    out = {}
    for name in ("padded", "packed", "sft_packed"):
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        data_collator = collator(folder, packing=name != "padded")
        if name == "sft_packed":
            args = trl.SFTConfig(**{**vl_training_args(f"{out_dir}/{name}").to_dict(), "hub_token": None,
                                    "dataset_kwargs": {"skip_prepare_dataset": True}})
            rows = datasets.Dataset.from_list([{k: v.tolist() for k, v in f.items()} for f in train_features(folder)])
            trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=rows, data_collator=data_collator,
                                         processing_class=AutoTokenizer.from_pretrained(folder))
        else:
            trainer = lf.LoongTrainer(model=model, args=vl_training_args(f"{out_dir}/{name}"),
                                      train_dataset=train_features(folder), data_collator=data_collator)
        trainer.train()
        out[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return out


def train_layout(folder: str, out_dir: str, layout: dict) -> list:
    """LoongTrainer, 3 steps on padded batches (length a multiple of 4) in ``layout``: logged losses."""
    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    trainer = lf.LoongTrainer(model=model, args=vl_training_args(out_dir), train_dataset=train_features(folder),
                              data_collator=collator(folder, pad_to_multiple_of=4))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_many(calls: list) -> dict:
    """Several of the functions above in one world: [(key, function name, args...)]."""
    return {key: globals()[fn](*args) for key, fn, *args in calls}


# micro-batches of two steps: images in some, none in others (the last of each step text-only)
MIXED_STEPS = [
    [[("text", "tok5 tok6"), ("image", (1, 4, 4)), ("text", "tok7")], [("text", "tok20 tok21 tok22 tok23")]],
    [[("text", "tok30 tok31")], [("image", (1, 4, 8)), ("text", "tok8 tok9")], [("text", "tok40 tok41 tok42")],
     [("text", "tok50 tok51 tok52 tok53")]],
]


def train_mixed_micro_batches(folder: str, out_dir: str, layout: dict, overlap_grad_reduce: bool) -> dict:
    """Engine steps of a Qwen2.5-VL with a trainable vision tower, micro-batches with and without images."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.0,
                                          max_grad_norm=1.0, report_to=[], use_cpu=True)
    engine = MegatronEngine(model, args=args, overlap_grad_reduce=overlap_grad_reduce)
    collate = collator(folder, pad_to_multiple_of=16)
    out = {"losses": [], "grad_norms": []}
    for step in (0, 1, 0, 1):
        micro = [collate(hand_features(folder, [pieces], seed=step * 10 + i)) for i, pieces in
                 enumerate(MIXED_STEPS[step])]
        result = engine.train_step(micro)
        out["losses"].append(result.loss)
        out["grad_norms"].append(result.grad_norm)
    return out


def train_mixed_with_and_without_overlap(folder: str, out_dir: str, layout: dict) -> dict:
    return {overlap: train_mixed_micro_batches(folder, f"{out_dir}/{overlap}", layout, overlap)
            for overlap in (True, False)}
