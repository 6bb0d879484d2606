"""Transformer Engine's FP8 recipes: ``from_pretrained(fp8="on", fp8_recipe="te_delayed" | "te_tensorwise" |
"te_blockwise" | "te_mxfp8")``, where Transformer Engine (the ``transformer_engine[pytorch]`` package) is installed.

Choices:
- Wired through megatron-core, not reimplemented: the model is built with the recipe in megatron's
  ``TransformerConfig`` (``fp8`` format and ``fp8_recipe``), so megatron's ``TransformerBlock`` runs its layers inside
  TE's ``fp8_autocast`` with the amax-reduction group of the layout (``fp8_utils.get_fp8_context``: one context around
  all layers for delayed scaling, one per layer otherwise), and the eligible linear slots of the layer spec hold
  megatron's TE linears (``TEColumnParallelLinear`` / ``TERowParallelLinear``), which carry megatron's
  tensor / sequence-parallel semantics.
- Which slots: ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` of attention, dense MLPs and shared
  experts (``te_linear_spec``). The norms stay our separate ``RMSNorm`` modules (TE's fused norm-linear modules hold
  the norm weight inside the linear, a layout the bridges do not load), so parameter names, shapes and the
  checkpoint mapping are the local spec's and the same bridges load and export the model. Routed experts, MLA's
  q / kv projections, the LM head, embeddings and router stay in the model's dtype (the four slot names above are the
  ones whose TE module takes megatron's local module's place one for one).
- Formats: ``hybrid`` (E4M3 forward, E5M2 gradients) for delayed and per-tensor current scaling, as TE's default
  delayed-scaling recipe; ``e4m3`` for the block-scaled recipes (TE's default for them).
- Every check that can fail runs before anything is built (``check_te_request``, then ``check_te_device`` once the
  backend is known to be CUDA): ``fp8="on"`` (``adaptive`` times this backend's own GEMMs), TE importable, and TE's
  own verdict on whether the GPU runs the recipe (MXFP8 needs compute capability 10.0).
"""

from __future__ import annotations

import importlib.util

from loongforge_hf.kernels.fp8 import Fp8Error

# fp8_recipe name -> (megatron-core Fp8Recipe, megatron fp8 format)
TE_RECIPES = {"te_delayed": ("delayed", "hybrid"), "te_tensorwise": ("tensorwise", "hybrid"),
              "te_blockwise": ("blockwise", "e4m3"), "te_mxfp8": ("mxfp8", "e4m3")}
TE_SLOTS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# TransformerConfig fields only fp8_recipe="te_..." sets (megatron_config may not)
TE_CONFIG_FIELDS = ("fp8", "fp8_recipe")


def is_te_recipe(recipe: str | None) -> bool:
    return recipe in TE_RECIPES


def _te_support(recipe: str) -> tuple[bool, str]:
    """TE's own (available, reason) for the recipe on the current CUDA device."""
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager as state

    kind = TE_RECIPES[recipe][0]
    checks = {"mxfp8": "is_mxfp8_available", "blockwise": "is_fp8_block_scaling_available"}
    check = checks.get(kind, "is_fp8_available")
    if not hasattr(state, check):  # an older TE than the recipe (megatron-core asks 2.3+ for block scaling)
        return False, f"this Transformer Engine has no {kind} recipe (FP8GlobalStateManager.{check} is missing)"
    return getattr(state, check)()


def check_te_request(fp8: str | None, recipe: str) -> None:
    """``Fp8Error`` unless ``fp8_recipe=recipe`` can be asked for here: ``fp8="on"`` and Transformer Engine
    importable (no device needed; ``check_te_device`` asks TE about the GPU)."""
    if fp8 != "on":
        raise Fp8Error(f"fp8_recipe={recipe!r} is a Transformer Engine recipe: use it with fp8='on' (fp8={fp8!r}; "
                       "'adaptive' times this backend's own FP8 GEMMs against bf16, see docs/fp8.md).")
    if importlib.util.find_spec("transformer_engine") is None:
        raise Fp8Error(f"fp8_recipe={recipe!r} needs Transformer Engine, which is not installed "
                       "(pip install 'transformer_engine[pytorch]'); this backend's own recipes (blockwise, "
                       "blockwise_wgrad2d, rowwise) need no extra package.")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # an install without its torch extension, or one built for another CUDA / torch
        raise Fp8Error(f"fp8_recipe={recipe!r}: Transformer Engine is installed but does not import "
                       f"({type(exc).__name__}: {exc}).") from exc


def check_te_device(recipe: str) -> None:
    """``Fp8Error`` with TE's reason where TE says the current CUDA device cannot run the recipe."""
    available, reason = _te_support(recipe)
    if not available:
        raise Fp8Error(f"fp8_recipe={recipe!r} does not run on this GPU: {reason}")


def te_config_fields(recipe: str) -> dict:
    """The megatron ``TransformerConfig`` fields that select the recipe."""
    kind, fmt = TE_RECIPES[recipe]
    return {"fp8": fmt, "fp8_recipe": kind}


def te_linear_spec(spec, *, column: type, row: type):
    """``spec`` (a megatron ``TransformerBlockSubmodules``, ``ModuleSpec`` or submodules dataclass) with
    ``column`` / ``row`` in every ``TE_SLOTS`` slot that holds megatron's local ``ColumnParallelLinear`` /
    ``RowParallelLinear``; routed experts (an ``experts`` slot) are left as they are."""
    import dataclasses

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    local = {ColumnParallelLinear: column, RowParallelLinear: row}

    def walk(node):
        """``node`` with the swaps made below it; the same object where nothing changed."""
        if isinstance(node, ModuleSpec):
            sub = walk(node.submodules)
            return node if sub is node.submodules else dataclasses.replace(node, submodules=sub)
        if isinstance(node, (list, tuple)):
            items = [walk(n) for n in node]
            return node if all(a is b for a, b in zip(items, node)) else type(node)(items)
        if not dataclasses.is_dataclass(node) or isinstance(node, type):
            return node
        changes = {}
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if field.name == "experts":
                continue
            if field.name in TE_SLOTS and isinstance(value, ModuleSpec) and value.module in local:
                new = dataclasses.replace(value, module=local[value.module])
            elif field.name in TE_SLOTS and isinstance(value, type):
                new = local.get(value, value)
            else:
                new = walk(value)
            if new is not value:
                changes[field.name] = new
        return dataclasses.replace(node, **changes) if changes else node

    return walk(spec)


def te_block_spec(spec):
    """``te_linear_spec`` with megatron's Transformer Engine linears."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    return te_linear_spec(spec, column=TEColumnParallelLinear, row=TERowParallelLinear)


def te_linears(chunks) -> list[str]:
    """Names (prefixed by chunk index) of the Transformer Engine linear modules of ``chunks``."""
    from transformer_engine.pytorch import Linear

    return [f"{i}.{name}" for i, chunk in enumerate(chunks) for name, m in chunk.named_modules()
            if isinstance(m, Linear)]


def te_report(chunks, recipe: str):
    """The ``Fp8Report`` of a model built with a TE recipe: its TE linears as the swapped layers."""
    from loongforge_hf.kernels.fp8_linear import Fp8Report

    return Fp8Report(mode="on", recipe=recipe, swapped=te_linears(chunks), skipped={})
