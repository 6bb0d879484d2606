"""Rank functions for test_qwen3_vl.py and test_qwen3_vl_moe.py: packed videos (timestamps between frames) against
the same padded, the MoE router outputs against transformers, and refusals (videos against transformers:
``_vl_features.compare_videos``)."""

import torch


def packed_against_padded(folder: str, layout: dict | None = None, multiple: int | None = None) -> dict:
    """The video samples packed in one row (per-frame positions from the collator) against the same padded: the
    loss and each sample's logits (in ``layout``, both batches padded to a ``multiple`` of tokens when given)."""
    import loongforge_hf as lf

    from ._vl_features import collator, hand_features

    features = hand_features(folder)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **(layout or {}))
    padded = collator(folder, pad_to_multiple_of=multiple)(features)
    packed = collator(folder, packing=True, pad_to_multiple_of=multiple)(features)
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
