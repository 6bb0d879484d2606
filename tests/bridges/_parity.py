"""Run inside each rank: load with loongforge-hf, compare with transformers, export."""

import torch


def load_compare_export(folder: str, layout: dict, out_dir: str, seq: int = 12, padded: bool = False):
    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    ref = hf_causal_lm(folder, dtype=torch.float32)  # NOTE: by class where Auto does not map (Mistral 4, Emu3)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, -4:] = 0  # right padding on the second row
        labels[1, -4:] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    with torch.no_grad():
        exp = ref(input_ids=ids, attention_mask=mask, labels=labels)
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    logit_diff = (out.logits - exp.logits).abs()[valid].max().item()
    loss_diff = abs(out.loss.item() - exp.loss.item())
    with torch.no_grad():  # NOTE: logits_to_keep cuts the rows before the logits cross TP / CP / PP ranks
        kept = model(input_ids=ids, attention_mask=mask, logits_to_keep=3).logits
    keep_diff = (kept - out.logits.detach()[:, -3:]).abs().max().item()
    grads_ok = None
    if layout.get("pipeline_parallel_size", 1) == 1:
        out.loss.backward()
        grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.save_pretrained(out_dir, max_shard_size="50KB")
    return {"logit_diff": logit_diff, "loss_diff": loss_diff, "loss": out.loss.item(), "ref_loss": exp.loss.item(),
            "grads_ok": grads_ok, "logits_shape": tuple(out.logits.shape), "keep": (tuple(kept.shape), keep_diff)}


def load_compare_export_many(cases: list, layout: dict):
    """``load_compare_export`` for several (folder, out_dir) pairs in one world (one process start per layout); a
    case's optional third item adds to ``layout`` (``sequence_parallel``)."""
    return [load_compare_export(folder, {**layout, **(more[0] if more else {})}, out_dir)
            for folder, out_dir, *more in cases]
