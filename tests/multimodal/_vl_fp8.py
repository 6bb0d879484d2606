"""Run inside one rank: Qwen2.5-VL with FP8 linear layers in the vision tower and the language model (CPU: the FP8
GEMMs are emulated from the same quantised operands)."""

import torch

from tests._calls import recorded_calls

from ._vl_features import collator, hand_features

IMAGES = [[("text", "tok5 tok6"), ("image", (1, 4, 6)), ("text", "tok7 tok8")],
          [("image", (1, 4, 4)), ("text", "tok10 tok11 tok12")]]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def fp8_checks(folder: str, cache: str) -> dict:
    import loongforge_hf as lf
    from loongforge_hf.kernels import fp8
    from loongforge_hf.kernels.fp8 import Fp8Error
    from loongforge_hf.kernels.fp8_linear import disable_fp8, swap_linears

    batch = collator(folder, pad_to_multiple_of=4)(hand_features(folder, IMAGES))
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    towers = [model.vision_tower]
    language = model.language_model.chunks
    out = model(**batch)
    out.loss.backward()
    ref_logits, ref_loss = out.logits.detach(), out.loss.item()
    ref_grads = {n: p.grad.clone() for n, p in model.vision_tower.named_parameters()}
    model.zero_grad(set_to_none=True)

    result = {}
    report = swap_linears(language, mode="on", recipe="rowwise", towers=towers)
    result["swapped"], result["skipped"] = report.swapped, report.skipped
    # shapes of the activations / gradients quantised row-wise: the vision GEMMs' among them
    with recorded_calls(fp8, "quantize_rows") as calls:
        out = model(**batch)
        out.loss.backward()
    result["quantised"] = sorted(set(calls["quantize_rows"]))
    valid = batch["attention_mask"].bool()
    result["logit_rel"] = _rel(out.logits.detach()[valid], ref_logits[valid])
    result["loss"], result["ref_loss"] = out.loss.item(), ref_loss
    grads = {n: p.grad for n, p in model.vision_tower.named_parameters()}
    result["vision_grad_rel"] = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads if grads[n] is not None}
    result["vision_tokens"] = int(batch["image_grid_thw"].prod(-1).sum())
    disable_fp8(language, towers)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        result["disabled_equal"] = torch.equal(model(**batch).logits, ref_logits)

    # adaptive: every shape timed on this CPU (emulated FP8 loses everywhere), each layer deciding on its own shapes
    report = swap_linears(language, mode="adaptive", recipe="rowwise", towers=towers, cache_path=cache)
    out = model(**batch)
    out.loss.backward()
    with torch.no_grad():
        result["adaptive_equal"] = torch.equal(model(**batch).logits, ref_logits)
    result["adaptive_rows"] = [row[:3] + row[5:] for row in report.autotuner.rows]  # every decision taken so far
    disable_fp8(language, towers)
    try:
        lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, fp8="on")
        result["cpu_error"] = None
    except Fp8Error as err:
        result["cpu_error"] = str(err)
    return result


def fp8_tensor_parallel_checks(folder: str) -> dict:
    """TP2 with the vision tower split too: the swap sees each rank's slices (layers whose local widths do not fit
    the recipe stay in their dtype); logits against the same model unswapped."""
    import loongforge_hf as lf
    from loongforge_hf.kernels.fp8_linear import swap_linears

    batch = collator(folder, pad_to_multiple_of=4)(hand_features(folder, IMAGES))
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                           vision_tensor_parallel_size=2)
    with torch.no_grad():
        ref = model(**batch).logits
    report = swap_linears(model.language_model.chunks, mode="on", recipe="rowwise", towers=[model.vision_tower])
    out = model(**batch)
    out.loss.backward()
    valid = batch["attention_mask"].bool()
    grads = [p.grad for p in model.vision_tower.parameters() if p.requires_grad]
    return {"swapped": report.swapped, "skipped": report.skipped,
            "logit_rel": _rel(out.logits.detach()[valid], ref[valid]),
            "grads_finite": all(g is not None and bool(torch.isfinite(g).all()) for g in grads)}
