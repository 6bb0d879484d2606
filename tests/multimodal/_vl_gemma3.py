"""Rank functions for tests/multimodal/test_gemma3_vl.py (module-level so spawned ranks can import them) and the
transformers reference they are compared with: hand-built Gemma 3 batches (``boi``, 16 image tokens, ``eoi`` per
image, ``token_type_ids`` as its processor gives them), random 56x56 images."""

from __future__ import annotations

import torch

from loongforge_hf.testing.tiny_vl import gemma3_image_prompt

# two rows of 44 tokens: three images (one spans the CP2 chunks' boundary), the first row padded by one token
ROWS = [[5, 6, -1, 7, 8, 9, -1, 10, 11, 0], [12, -1] + list(range(13, 38))]
TEXT_ROWS = [list(range(5, 25)), list(range(30, 50))]


def make_batch(rows=ROWS, *, images: int | None = None, seed: int = 1, token_types: bool = True) -> dict:
    """input_ids, attention_mask (0 on the pad id 0), labels (-100 there and on image tokens),
    token_type_ids, pixel_values ``[n, 3, 56, 56]``."""
    input_ids, token_type_ids = gemma3_image_prompt(rows)
    mask = (input_ids != 0).long()  # NOTE: id 0 is the pad token; the rows' text ids start at 5
    labels = input_ids.masked_fill((mask == 0) | (token_type_ids == 1), -100)
    count = images if images is not None else sum(row.count(-1) for row in rows)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    if count:
        batch["pixel_values"] = torch.randn(count, 3, 56, 56, generator=torch.Generator().manual_seed(seed))
    if token_types:
        batch["token_type_ids"] = token_type_ids
    return batch


# transformers' vision tower and projector modules: llava's naming (Gemma 3, Mistral 3, InternVL), Idefics3's;
# LLaVA-NeXT's image_newline; Llama 4's (top-level vision_model / multi_modal_projector)
VISION_TREES = ("model.vision_tower.", "model.multi_modal_projector.", "model.vision_model.", "model.connector.",
                "model.image_newline", "vision_model.", "multi_modal_projector.")


def _hf_name(name: str) -> str:
    """A transformers parameter or checkpoint name without the naming's prefixes: ``vision_tower.…``,
    ``multi_modal_projector.…``."""
    name = name[len("model."):] if name.startswith("model.") else name
    return name.replace("vision_tower.vision_model.", "vision_tower.")


def hf_reference(folder: str, batch: dict):
    """transformers' logits, loss and vision tower / projector gradients (``_hf_name``) on ``batch``."""
    import transformers

    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    out = ref(**batch)
    out.loss.backward()
    grads = {_hf_name(n): p.grad for n, p in ref.named_parameters()
             if n.startswith(VISION_TREES) and p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def vision_grads(model) -> dict:
    """HF name (``_hf_name``) -> full gradient of every vision tower and projector parameter, first stage."""
    from ._vl_parity import vision_grads as grads_by_name

    return grads_by_name(model, rename=_hf_name)


def compare(folder: str, layout: dict, out_dir: str | None = None, *, batch: dict | None = None,
            auto_class: str = "AutoModelForImageTextToText", batch_for=None) -> dict:
    """Logits (kept tokens), loss and vision gradients against transformers' on ``batch`` (default:
    ``(batch_for or make_batch)()``); the model exported to ``out_dir``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import loongforge_hf as lf

    batch = batch if batch is not None else (batch_for or make_batch)()
    ref_logits, ref_loss, ref_grads = hf_reference(folder, batch)
    model = getattr(lf, auto_class).from_pretrained(folder, dtype=torch.float32, **layout)
    if layout.get("language_recompute"):
        model.train()  # NOTE: recompute runs in training only (no dropout in these models)
    out = model(**batch)
    valid = batch["attention_mask"].bool()
    result = {"class": type(model).__name__, "logit_diff": (out.logits - ref_logits).abs()[valid].max().item(),
              "loss_diff": abs(out.loss.item() - ref_loss.item()), "grad_diff": None, "grads": 0,
              "vision_layout": model.vision_layout, "logits_shape": tuple(out.logits.shape)}
    if layout.get("pipeline_parallel_size", 1) == 1:
        out.loss.backward()
        grads = vision_grads(model)
        if layout.get("context_parallel_size", 1) > 1:  # NOTE: each CP rank's gradient is its share's
            for g in grads.values():
                dist.all_reduce(g, group=ps.get_context_parallel_group())
        if ref_grads:
            assert sorted(grads) == sorted(ref_grads), sorted(set(grads) ^ set(ref_grads))
            result["grad_diff"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
            result["grads"] = len(ref_grads)
    if out_dir is not None:
        model.save_pretrained(out_dir, max_shard_size="60KB")
    return result


def compare_many(cases: list) -> dict:
    """``compare`` for each (name, folder, layout, out_dir, extra keywords) in one world."""
    return {name: compare(folder, layout, out_dir, **extra) for name, folder, layout, out_dir, extra in cases}


def refusal(folder: str, layout: dict, batch: dict) -> str:
    """The error (type: message) a forward of ``batch`` raises under ``layout``."""
    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    try:
        model(**batch)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {error}"
    return "no error"


# ---- generate ------------------------------------------------------------------------------------------------------

def prompts() -> dict:
    """A left-padded prompt batch: a row with two images, a row with one, as ``generate`` takes them."""
    batch = make_batch([[5, -1, 6, 7, -1, 8], [0] * 18 + [9, 10, -1, 11, 12]])
    left = batch["input_ids"] != 0
    return {"input_ids": batch["input_ids"], "attention_mask": left.long(), "pixel_values": batch["pixel_values"],
            "token_type_ids": batch["token_type_ids"]}


SCENARIOS = {"greedy": dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True),
             "uncached": dict(max_new_tokens=5, do_sample=False, use_cache=False, return_dict_in_generate=True,
                              output_logits=True),
             "beam": dict(max_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False,
                          return_dict_in_generate=True, output_scores=True)}


def generate_both(folder: str, layout: dict, prompts=prompts, scenarios: dict | None = None) -> dict:
    """transformers' (``AutoModelForImageTextToText``) and ours ``generate`` on ``prompts()`` per scenario (default:
    ``SCENARIOS`` and the static cache): sequences equal, logits / scores within."""
    import transformers

    import loongforge_hf as lf

    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    if scenarios is None:
        scenarios = {**SCENARIOS, "static": {**SCENARIOS["greedy"], "cache_implementation": "static"}}
    return generate_pair(model, ref, prompts(), scenarios)


def generate_pair(model, ref, inputs: dict, scenarios: dict = SCENARIOS) -> dict:
    """``model.generate`` against ``ref.generate`` on ``inputs`` per scenario: sequences equal, the largest difference
    of logits (scores for ``"beam"``), the steps compared."""
    out = {}
    for name, kwargs in scenarios.items():
        want = ref.generate(**inputs, **kwargs, pad_token_id=0)
        got = model.generate(**inputs, **kwargs, pad_token_id=0)
        steps = "scores" if name == "beam" else "logits"
        diffs = [(a - b).abs().masked_fill(torch.isinf(a) & torch.isinf(b), 0).max().item()
                 for a, b in zip(getattr(got, steps), getattr(want, steps))]
        out[name] = {"same_sequences": torch.equal(got.sequences, want.sequences), "max_diff": max(diffs),
                     "steps": len(diffs)}
    return out


# ---- the processor, the collator, training ---------------------------------------------------------------------------

TRAIN_TEXTS = [f"tok{5 + i} <start_of_image> tok{30 + i} tok{40 + i}" for i in range(4)] + \
    [f"tok{60 + i} tok{70 + i} tok{80 + i}" for i in range(4)]


def train_features(folder: str) -> list:
    """Each sample through the checkpoint's ``Gemma3Processor`` (a random image of another size, resized to 56x56)."""
    import numpy as np

    from loongforge_hf.testing.tiny_vl import processor_for

    processor = processor_for(folder)
    rng = np.random.RandomState(5)
    return [dict(processor(text=[text], images=[[rng.randint(0, 256, (40, 70, 3), dtype=np.uint8)]]
                           if "<start_of_image>" in text else None, return_tensors="pt")) for text in TRAIN_TEXTS]


def train(folder: str, out_dir: str, *, loong: bool) -> list:
    """Three steps of batches of 2 with the ViT frozen (the projector trains): the logged losses."""
    from loongforge_hf.testing.tiny_vl import processor_for

    from ._vl_parity import frozen, trained_losses

    return trained_losses(folder, out_dir, loong=loong, processor=processor_for(folder),
                          features=train_features(folder), freeze=frozen("vision_tower"))


def train_both(folder: str, out_dir: str) -> dict:
    return {"hf": train(folder, out_dir + "/hf", loong=False), "loong": train(folder, out_dir + "/loong", loong=True)}


def packed_against_padded(folder: str) -> dict:
    """The processor's samples collated padded and packed (one row, 2-D positions restarting per sample): the same
    logits at every real token, and transformers' padded batch's."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_vl import processor_for

    features = train_features(folder)[2:6]
    collator = DataCollatorForImageText.from_processor(processor_for(folder))
    padded = collator(features)
    packed = DataCollatorForImageText.from_processor(processor_for(folder), packing=True)(features)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        got_padded = model(**padded).logits
        got_packed = model(**packed).logits
        want = ref(**padded).logits
    valid = padded["attention_mask"].bool()
    return {"packed_shape": tuple(packed["input_ids"].shape), "positions": tuple(packed["position_ids"].shape),
            "token_types": int(packed["token_type_ids"].sum()),
            "packed_diff": (got_packed[0] - got_padded[valid]).abs().max().item(),
            "padded_diff": (got_padded - want).abs()[valid].max().item()}


def generate_layouts(folder: str, layouts: dict) -> dict:
    """``generate_both`` under each of ``layouts`` in one world."""
    return {name: generate_both(folder, layout) for name, layout in layouts.items()}
