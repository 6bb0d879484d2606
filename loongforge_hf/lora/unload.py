"""PEFT's ``merge_and_unload`` / ``unload`` / ``disable_adapter`` on a ``LoongLoraModelForCausalLM``.

Choices:
- ``merge_and_unload`` adds ``scaling * B @ A`` into every adapted weight (float32 product added in the weight's
  dtype, as the merged export does), writes the trained token rows into the embedding, then removes the adapters:
  each adapted megatron module gets its own class back (the LoRA classes are direct subclasses of megatron's), loses
  its ``lora`` child, and the model becomes a ``LoongModelForCausalLM`` again, in place. The base parameters keep
  their ``requires_grad`` (frozen but for ``modules_to_save``, as after PEFT's), so the result saves as a plain HF
  checkpoint or trains on.
- ``modules_to_save`` train in place; their values at ``get_peft_model`` (or ``load_adapter``) are kept aside, as
  PEFT keeps the original modules beside the trained copies (``lora_originals``: one more copy of those tensors).
  ``unload`` removes the adapters without merging them and puts those originals back: the base model as it was.
- ``disable_adapter()`` (a context manager) runs the base model: every adapter and trainable token row is skipped
  and the ``modules_to_save`` tensors hold their originals inside the block (copied in and back, so megatron's
  buffers and the optimizer keep their tensors).
- All three refuse a model held by a training engine (its gradient buffers and optimizer hold the adapters), so
  release the engine first (``trainer.engine.release()``).
"""

from __future__ import annotations

import contextlib

import torch


def _check_free(model, what: str) -> None:
    if model._held_by_engine():
        raise TypeError(f"{what}: this model is held by a training engine (its gradient buffers and optimizer hold "
                        "the adapters); release it first (trainer.engine.release()).")


def _lora_modules(model) -> list:
    return [m for chunk in model.chunks for m in chunk.modules() if "lora" in m._modules]


def merge_and_unload(model, *, safe_merge: bool = False, adapter_names=None):
    """Merge the adapters into the base weights and remove them; returns ``model`` (a ``LoongModelForCausalLM``)."""
    from loongforge_hf.lora.export import _lora_deltas
    from loongforge_hf.lora.tokens import merged_token_rows

    _check_free(model, "merge_and_unload")
    if adapter_names not in (None, ["default"]):
        raise ValueError(f"merge_and_unload(adapter_names={adapter_names!r}): this model has one adapter, 'default'.")
    with torch.no_grad():
        merged = [(weight, weight + delta.to(weight.dtype)) for weight, delta in _lora_deltas(model)]
        merged += [(weight, weight.index_copy(0, rows, values.to(weight.dtype)))
                   for weight, rows, values in merged_token_rows(model)]
        if safe_merge and not all(bool(torch.isfinite(new).all()) for _, new in merged):
            raise ValueError("merge_and_unload(safe_merge=True): the merged weights have NaN or inf values; the "
                             "adapters seem to be broken. Nothing was merged.")
        for weight, new in merged:
            weight.copy_(new)
    return _remove_adapters(model, restore_saved=False)  # NOTE: PEFT keeps the trained modules_to_save copies


def unload(model):
    """Remove the adapters without merging them, ``modules_to_save`` back to their originals; returns ``model`` (a
    ``LoongModelForCausalLM``)."""
    _check_free(model, "unload")
    return _remove_adapters(model, restore_saved=True)


def _remove_adapters(model, *, restore_saved: bool):
    from loongforge_hf.lora.tokens import remove_token_hooks, token_embeddings

    if restore_saved:
        with torch.no_grad():
            for param, original in model.lora_originals:
                param.copy_(original)
    for module in _lora_modules(model):
        del module.lora
        module.__dict__.pop("lora_layout", None)
        module.__dict__.pop("lora_tp_group", None)
        module.__class__ = type(module).__mro__[1]
    for embedding in token_embeddings(model):
        del embedding.token_adapter
    for chunk in model.chunks:
        remove_token_hooks(chunk)
    model.__class__ = model.lora_base_class
    for name in ("lora_config", "lora_plan", "lora_originals", "lora_base_class"):
        model.__dict__.pop(name, None)
    return model


@contextlib.contextmanager
def disable_adapter(model):
    """The base model inside the block: adapters and trainable token rows skipped."""
    from loongforge_hf.lora.tokens import token_embeddings

    switched = _lora_modules(model) + [e.token_adapter for e in token_embeddings(model)]
    with torch.no_grad():
        trained = [(param, param.detach().clone()) for param, _ in model.lora_originals]
        for param, original in model.lora_originals:
            param.copy_(original)
    for module in switched:
        module.lora_disabled = True
    try:
        yield
    finally:
        for module in switched:
            module.lora_disabled = False
        with torch.no_grad():
            for param, values in trained:
                param.copy_(values)
