"""Rank functions for test_qwen3_vl.py: Qwen3-VL with videos (timestamps between frames) against transformers, and
refusals."""

import torch

from ._vl_parity import vision_grads

V_START, V_END, IMAGE, VIDEO = 200, 201, 202, 203
PATCH = 3 * 2 * 16 * 16  # C x temporal patch x patch x patch

# pieces per sample: ("text", "tok5 tok6"), ("image", (1, h, w)), ("video", (t, h, w)): a video's frames each follow
# a timestamp token, as Qwen3-VL's processor lays them out
VIDEO_SAMPLES = [
    [("text", "tok5 tok6"), ("image", (1, 4, 6)), ("text", "tok7"), ("video", (2, 4, 4)), ("text", "tok8 tok9")],
    [("video", (3, 2, 4)), ("text", "tok10 tok11 tok12")],
    [("text", "tok20 tok21 tok22 tok23")],
]


def video_features(folder: str, samples=VIDEO_SAMPLES, seed: int = 7) -> list:
    """Processor-like features built by hand (transformers' video processor needs torchvision)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
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
            kind, (t, h, w) = piece
            token, code = (IMAGE, 1) if kind == "image" else (VIDEO, 2)
            for frame in range(t if kind == "video" else 1):
                if kind == "video":  # NOTE: the frame's timestamp ("<1.0 seconds>" in the real processor)
                    ids.append(tok.convert_tokens_to_ids(f"tok{50 + frame}"))
                    kinds.append(0)
                n = (1 if kind == "video" else t) * h * w // 4
                ids += [V_START] + [token] * n + [V_END]
                kinds += [0] + [code] * n + [0]
            pixels, grid = ("pixel_values", "image_grid_thw") if kind == "image" else \
                ("pixel_values_videos", "video_grid_thw")
            rows = torch.randn(t * h * w, PATCH, generator=gen)
            f[pixels] = torch.cat([f[pixels], rows]) if pixels in f else rows
            f[grid] = torch.cat([f.get(grid, torch.zeros(0, 3, dtype=torch.long)), torch.tensor([[t, h, w]])])
        f.update(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                 mm_token_type_ids=torch.tensor([kinds]))
        features.append(f)
    return features


def collate(folder: str, features: list, **kwargs) -> dict:
    from transformers import AutoConfig

    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_vl import processor_for

    return DataCollatorForImageText.from_processor(processor_for(folder), AutoConfig.from_pretrained(folder),
                                                   **kwargs)(features)


_REFERENCE: dict = {}


def hf_reference(folder: str, multiple: int):
    """(batch, logits, loss, vision grads) of transformers on the video samples padded to ``multiple``."""
    import transformers

    if (folder, multiple) not in _REFERENCE:
        batch = collate(folder, video_features(folder), pad_to_multiple_of=multiple)
        ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        out = ref(**batch)
        out.loss.backward()
        grads = {n[len("model.visual."):]: p.grad for n, p in ref.named_parameters() if n.startswith("model.visual.")}
        _REFERENCE[folder, multiple] = (batch, out.logits.detach(), out.loss.detach(), grads)
    return _REFERENCE[folder, multiple]


def compare_videos(folder: str, layout: dict, multiple: int = 4) -> dict:
    """Logits, loss and vision gradients (summed over the CP group) against transformers; the model in training
    mode (recomputation acts there)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import loongforge_hf as lf

    batch, ref_logits, ref_loss, ref_grads = hf_reference(folder, multiple)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    model.train()
    out = model(**batch)
    out.loss.backward()
    grads = vision_grads(model)
    if ps.get_context_parallel_world_size() > 1:
        for g in grads.values():
            dist.all_reduce(g, group=ps.get_context_parallel_group())
    valid = batch["attention_mask"].bool()
    return {"logit_diff": (out.logits - ref_logits).abs()[valid].max().item(),
            "loss_diff": abs(out.loss.item() - ref_loss.item()),
            "grad_diff": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            "same_grad_names": sorted(grads) == sorted(ref_grads), "shape": tuple(out.logits.shape),
            "batch_shape": tuple(batch["input_ids"].shape)}


def packed_against_padded(folder: str) -> dict:
    """The video samples packed in one row (per-frame positions from the collator) against the same padded: the
    loss and each sample's logits."""
    import loongforge_hf as lf

    features = video_features(folder)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    padded = collate(folder, features)
    packed = collate(folder, features, packing=True)
    with torch.no_grad():
        out_padded, out_packed = model(**padded), model(**packed)
    diffs, start = [], 0
    for row, f in enumerate(features):
        n = f["input_ids"].shape[1]
        diffs.append((out_packed.logits[0, start:start + n] - out_padded.logits[row, :n]).abs().max().item())
        start += n
    # NOTE: the packed loss skips each sample's first label (no sample predicts the next one's first token)
    return {"rows": tuple(packed["input_ids"].shape), "logit_diff": max(diffs),
            "position_rows": tuple(packed["position_ids"].shape)}


def load_error(folder: str, layout: dict) -> str:
    """The error ``from_pretrained`` raises on this rank (type and message), or "" when it loads."""
    import loongforge_hf as lf

    try:
        lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    except Exception as err:  # noqa: BLE001  (the test checks which)
        return f"{type(err).__name__}: {err}"
    return ""


def compare_router_outputs(folder: str, layout: dict, multiple: int = 4) -> dict:
    """A checkpoint whose text_config asks for the router outputs (``output_router_logits``): loss (with
    ``router_aux_loss_coef * aux_loss``), ``aux_loss``, ``router_logits`` and the router weights' gradients against
    transformers' (gradients summed over the ranks that split the tokens, as megatron sums them)."""
    import torch.distributed as dist
    import transformers
    from megatron.core import parallel_state as ps

    import loongforge_hf as lf

    from ._vl_parity import SAMPLES, make_batch

    batch = make_batch(folder, SAMPLES, pad_to_multiple_of=multiple)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    exp = ref(**batch)
    exp.loss.backward()
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = model(**batch)
    out.loss.backward()
    router_grads = {}  # NOTE: layouts without pipeline stages: local layer = global layer
    for name, p in model.named_parameters():
        if name.endswith("mlp.router.weight"):
            g = p.grad.clone()
            if ps.get_context_parallel_world_size() > 1:
                dist.all_reduce(g, group=ps.get_context_parallel_group())
            if getattr(p, "sequence_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
                # NOTE: each TP rank's tokens' part, summed as megatron's finalize_model_grads sums it
                dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
            router_grads[int(name.split("layers.")[1].split(".")[0])] = g
    ref_grads = {i: m.mlp.gate.weight.grad for i, m in enumerate(ref.model.language_model.layers)
                 if hasattr(m.mlp, "gate")}
    return {"loss_diff": abs(out.loss.item() - exp.loss.item()),
            "aux_diff": abs(out.aux_loss.item() - exp.aux_loss.item()), "aux": exp.aux_loss.item(),
            "router_logit_diff": max((a - b).abs().max().item() for a, b in zip(out.router_logits, exp.router_logits)),
            "router_layers": (len(out.router_logits), len(exp.router_logits)),
            "router_grad_diff": max((router_grads[i] - ref_grads[i]).abs().max().item() for i in ref_grads),
            "logit_diff": (out.logits - exp.logits).abs()[batch["attention_mask"].bool()].max().item()}
