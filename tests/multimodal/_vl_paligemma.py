"""Rank functions for tests/multimodal/test_paligemma.py (module-level so spawned ranks can import them): PaliGemma
batches as its processor lays them out (64 ``<image>``, ``<bos>``, the prefix, ``\\n``, the suffix; token_type_ids
0 on the image and prefix, 1 on the suffix), right-padded, compared with transformers; LoRA against PEFT through the
shared ``_vl_lora`` checks (test_aya_vision.py's too)."""

from __future__ import annotations

from loongforge_hf.testing.tiny_paligemma import paligemma_prompt

# two rows: prefixes of 3 and 2 tokens, suffixes of 5 and 2, the second row right-padded (80 = a multiple of 2 x CP)
ROWS = [([5, 6, 7], [8, 9, 10, 11, 12]), ([13, 14], [15, 16])]
# NOTE: unpadded (80 tokens a row): ``_vl_lora.model_checks`` compares every position's logits, and at padding
# positions transformers' prefix block takes the pad queries (token_type_ids 0) where ours keeps them out of it
FULL_ROWS = [([5, 6, 7], list(range(8, 19))), ([13, 14], list(range(15, 27)))]

# init_lora_weights=False keeps B random, so every adapter moves the logits; scaling 1 (_vl_lora.CONFIGS says why)
LORA_CONFIGS = {
    # the language model's linears only (attention and MLP of every layer: PEFT's regex over the module tree)
    "language": dict(r=4, lora_alpha=4, target_modules=r".*language_model\.layers\.\d+\..*_proj",
                     init_lora_weights=False),
    # PEFT's "all-linear": the language model's, SigLIP's and the projector's linears (not the tied LM head)
    "all_linear": dict(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False),
}
# NOTE: within 5e-5 of the tensor's largest entry, as test_gemma3_vl_lora.py's (the same SigLIP blocks; measured
# here: up to 6e-6)
GRAD_TOL = 5e-5


def make_batch(*, token_types: bool = True, rows: list = ROWS) -> dict:
    batch = paligemma_prompt(rows, seed=1, pad_to=80)
    if not token_types:
        batch.pop("token_type_ids")
    return batch


def prompts() -> dict:
    """Left-padded prefixes (token_type_ids 0 throughout), as ``generate`` takes them."""
    batch = paligemma_prompt([([5, 6, 7, 8], []), ([9], [])], seed=2)
    flip = {k: batch[k].flip(-1) for k in ("input_ids", "attention_mask")}  # NOTE: right padding -> left
    ids, mask = (batch[k].clone() for k in ("input_ids", "attention_mask"))
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        ids[row], mask[row] = flip["input_ids"][row].roll(n), flip["attention_mask"][row].roll(n)
        ids[row, -n:], mask[row, -n:] = batch["input_ids"][row, :n], 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": ids.new_zeros(ids.shape),
            "pixel_values": batch["pixel_values"]}


def lora_checks(lora: tuple | None, batch: dict) -> dict:
    """``_vl_lora.model_checks`` (logits, loss and adapter gradients against PEFT's, the adapter folder in PEFT, the
    merged export in transformers) on ``batch`` for ``lora`` (folder, out_dir, {case: (layout, ``LORA_CONFIGS``
    names)}), under ``lora`` by ``case/name`` (``_vl_parity.check_lora_vs_peft`` reads them); empty without it."""
    from ._vl_lora import model_checks

    if lora is None:
        return {}
    folder, out_dir, cases = lora
    return {"lora": {f"{case}/{name}": model_checks(folder, f"{out_dir}/{case}-{name}", layout, name, LORA_CONFIGS,
                                                    batch_for=lambda _: batch, grad_tol=GRAD_TOL)
                     for case, (layout, names) in cases.items() for name in names}}


def peft_written(case: tuple | None, batch: dict) -> dict:
    """``_vl_lora.peft_adapter_checks`` for ``case`` (folder, out_dir, layout) on ``batch`` under ``peft_adapter``:
    a PEFT-written "all-linear" adapter (the language model's final norm whole) loaded here; empty without one."""
    from ._vl_lora import peft_adapter_checks

    if case is None:
        return {}
    folder, out_dir, layout = case
    return {"peft_adapter": peft_adapter_checks(folder, out_dir, layout, saved=("language_model.norm",),
                                                lora_alpha=2, batch=batch)}


def checks(*, cases: list, generation: tuple | None = None, lora: tuple | None = None,
           peft_adapter: tuple | None = None) -> dict:
    """``_vl_gemma3.compare`` (logits, loss, vision gradients; the export where ``out_dir`` is given) for each
    (name, folder, layout, out_dir, batch keywords) of ``cases``; with ``generation`` (folder, scenarios),
    ``_vl_gemma3.generate_both`` on ``prompts()``; ``lora_checks`` of ``lora`` and ``peft_written(peft_adapter)`` on
    the unpadded batch (``FULL_ROWS``)."""
    from ._vl_gemma3 import compare, generate_both

    out = {name: compare(folder, layout, out_dir, batch=make_batch(**extra))
           for name, folder, layout, out_dir, extra in cases}
    if generation is not None:
        folder, scenarios = generation
        out["generate"] = generate_both(folder, {}, prompts, scenarios)
    full = make_batch(rows=FULL_ROWS)
    return {**out, **lora_checks(lora, full), **peft_written(peft_adapter, full)}
