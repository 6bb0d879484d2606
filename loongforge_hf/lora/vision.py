"""LoRA on Qwen2.5-VL and Qwen3-VL (``lf.AutoModelForImageTextToText``): the language model's layers as on a text
model, and the vision tower's linears (ViT attention and MLP, the patch merger, Qwen3-VL's DeepStack mergers) as PEFT
adapts them.

Choices:
- Targets are matched on transformers' own image-text module tree (``model.language_model.layers.N...``,
  ``model.visual.blocks.N...``, ``lm_head``), the names PEFT matches and writes adapter keys with; each is looked up
  in the checkpoint under the names the bridge read (hub: ``model.layers.N...`` / ``visual.*``; older files:
  ``model.language_model.*`` / ``model.visual.*``). ``"all-linear"`` adapts the tower's linears too, as PEFT does.
- Language targets and ``modules_to_save`` (norms, an untied LM head, the embedding) go through the text-model
  machinery on the language chunks (``model.py``), unchanged; so do Qwen3-VL-MoE's routed experts and routers, named
  by PEFT's ``target_parameters`` (``param_targets.py``, ``experts.py``).
- Vision targets: the tower's ``VisionLinear`` becomes ``LoraVisionLinear``, whose one matmul (which the tower's
  row-split projections call without their bias) adds ``scaling * B (A dropout(x))``. The tower lives on the first
  pipeline stage; with the default layout it is replicated over TP (every TP rank encodes every image and gets the
  whole gradient), so A and B are whole and replicated too, like the tower's own weights, and dropout draws from
  the default generator, which megatron keeps in step over TP. With ``vision_data_parallel=True`` each TP rank
  encodes a share of the images and the tower's trainable parameters, the adapters among them, have their gradients
  summed over TP (``encoder_parallel``).
- The tower split over TP (``vision_tensor_parallel_size > 1``): adapters split as the weight is. Column-split
  (``qkv`` by heads in each of its q, k, v blocks, MLP gate / up / ``linear_fc1`` by rows): B holds this rank's rows,
  A is whole and enters through megatron's copy-to-TP-region (its gradient, partial per rank, summed); the input
  gradient is summed by the tower's own copy-to-region before the linear. Row-split (attention ``proj``, MLP down /
  ``linear_fc2``): A holds this rank's input columns (dropout from megatron's model-parallel RNG tracker: each shard
  its own mask), the partial ``B (A_r x_r)`` is summed by the tower's reduction with the weight's, and B is whole, its
  gradient summed the same way. The mergers (DeepStack's too) stay whole. Split factors carry megatron's
  tensor-parallel attributes (the gradient norm counts every shard), and checkpoints hold them at HF shapes
  (``multimodal.vision_weights``).
- Gemma 3 (``Gemma3ForConditionalGeneration``): the module tree is ``model.language_model.*``, ``model.vision_tower.*``
  (SigLIP) and ``model.multi_modal_projector.*``, PEFT's names whatever the checkpoint's naming (the bridge's
  ``module_trees``, ``bridges/gemma3_vl.py``). SigLIP's ``q_proj`` / ``k_proj`` / ``v_proj`` are three HF linears the
  tower holds as one fused ``attn.qkv`` (``[q; k; v]`` rows, each split by heads under TP): each keeps its own adapter,
  whose term is added to its block of the fused output (``rows``) and merged into those rows; under a split tower B
  holds this rank's heads' rows (as a column-split linear). ``out_proj`` / ``fc1`` / ``fc2`` are the tower's
  ``attn.proj`` / ``mlp.linear_fc1`` / ``mlp.linear_fc2``; the projector's ``mm_input_projection_weight`` is a
  parameter, not a linear (PEFT adapts none there either). DoRA on the fused q / k / v is refused (``dora.check_dora``).
- Mistral 3 (``Mistral3ForConditionalGeneration``): ``model.language_model.*``, ``lm_head``, ``model.vision_tower.*``
  (Pixtral: its ``attention.q_proj`` / ``k_proj`` / ``v_proj`` on the fused ``qkv`` as Gemma 3's, ``o_proj``,
  ``feed_forward.gate_proj`` / ``up_proj`` / ``down_proj``) and ``model.multi_modal_projector.*`` (``linear_1``,
  ``linear_2``, ``patch_merger.merging_layer``: whole), whatever the checkpoint's naming.
- InternVL (``InternVLForConditionalGeneration``): the same trees as Mistral 3's, InternViT's
  ``attention.q_proj`` / ``k_proj`` / ``v_proj`` on the fused ``qkv`` as Gemma 3's, ``projection_layer``,
  ``mlp.fc1`` / ``fc2``, the projector's ``linear_1`` / ``linear_2`` (whole).
- LLaVA (``LlavaForConditionalGeneration``): the same trees, CLIP's ``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` on
  the fused ``qkv`` as Gemma 3's, ``out_proj``, ``mlp.fc1`` / ``fc2``, the projector's two (whole). The ViT blocks after
  the feature layer take adapters as in PEFT; they never run, so their gradient is zero (PEFT's None).
- SmolVLM / Idefics3: ``model.text_model.*``, ``lm_head``, ``model.vision_model.*`` (SigLIP, as Gemma 3's) and
  ``model.connector.modality_projection.proj`` (whole), the checkpoint's names too.
- Not here: ``trainable_token_indices`` on an image-text model (refused), and modules_to_save in the vision tower
  (refused: name them in the adapter's targets, or train the tower whole without LoRA).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from torch import nn

from loongforge_hf.lora.model import LoongLoraModelForCausalLM
from loongforge_hf.lora.plan import LoraConfigError
from loongforge_hf.multimodal.modeling import LoongModelForImageTextToText
from loongforge_hf.multimodal.vision import VisionLinear

TREE_TEXT, TREE_VISION = "model.language_model.", "model.visual."


class LoongLoraModelForImageTextToText(LoongLoraModelForCausalLM, LoongModelForImageTextToText):
    """A ``LoongModelForImageTextToText`` with LoRA adapters (made by ``get_peft_model``)."""


def lora_class_for(model) -> type:
    from loongforge_hf.lora.sequence_classification import (LoongLoraModelForSequenceClassification,
                                                            LoongModelForSequenceClassification)

    if isinstance(model, LoongModelForSequenceClassification):
        return LoongLoraModelForSequenceClassification
    return LoongLoraModelForImageTextToText if isinstance(model, LoongModelForImageTextToText) \
        else LoongLoraModelForCausalLM


def text_bridge(model):
    """The bridge of the model's language layers (the model's own for a text model)."""
    return getattr(model.bridge, "text", model.bridge)


def chunk_params(chunk) -> dict[str, nn.Parameter]:
    """A chunk's parameters by megatron name (an image-text chunk's language parameters without ``language.``)."""
    return {n.removeprefix("language."): p for n, p in chunk.named_parameters()}


def checkpoint_names(vl_bridge):
    """HF module-tree name -> checkpoint name (identity for a text model)."""
    if vl_bridge is None:
        return lambda name: name
    # NOTE: (module-tree prefix, the bridge attribute holding its checkpoint prefix): the bridge's, else Qwen's
    trees = getattr(vl_bridge, "module_trees", None) or ((TREE_TEXT, "text_prefix"), (TREE_VISION, "vision_prefix"))
    prefixes = [(tree, getattr(vl_bridge, attribute) + ".") for tree, attribute in trees]

    def on_disk(name: str) -> str:
        for tree, disk in prefixes:
            if name.startswith(tree):
                return disk + name[len(tree):]
        return name
    return on_disk


def vision_index(vl_bridge) -> dict:
    """Checkpoint name of each tower linear's weight -> (its mapping, renamed to the module in the chunk,
    ``vision.*``, None, its position among the mapping's HF names: Gemma 3's q / k / v in the fused ``qkv``); empty
    for a text model."""
    if vl_bridge is None:
        return {}
    out = {}
    for name, (mapping, block) in vl_bridge.vision_mapping_table().items():
        if name.endswith(".weight") and "norm" not in name and "ln_q" not in name and "patch_embed" not in name:
            for slot, hf_name in enumerate(mapping.hf_names(block)):
                out[hf_name] = (replace(mapping, megatron=f"vision.{name}"), None, slot)
    return out


def plan_image_text(model, config):
    """The LoRA plan of ``config`` on an image-text ``model``; refused, before anything changes, what this module
    does not do."""
    from loongforge_hf.lora.plan import plan_lora

    plan = plan_lora(model.bridge.text, config, vl_bridge=model.bridge)
    if plan.token_indices:
        raise LoraConfigError("trainable_token_indices is not supported on image-text models; train the embedding "
                              "whole (modules_to_save=['embed_tokens']) or use a text model.")
    return plan


def tower_split(t) -> str | None:
    """How a tower target's adapter is split when the tower is: "qkv" (B's rows in each of the q, k, v blocks),
    "column" (B's rows), "row" (A's columns) or None (the merger, whole)."""
    from loongforge_hf.bridges.gemma3_vl import QKVRows
    from loongforge_hf.bridges.mappings import ColumnParallel, RowParallel
    from loongforge_hf.bridges.qwen2_5_vl import FusedQKVRows

    if isinstance(t.mapping, FusedQKVRows):
        return "qkv"
    # NOTE: Gemma 3's q / k / v (QKVRows) are each a column-split linear of their own, one block of the fused rows
    if isinstance(t.mapping, (ColumnParallel, QKVRows)):
        return "column"
    return "row" if isinstance(t.mapping, RowParallel) else None


def split_factor(split: str | None) -> str | None:
    """Which factor of an adapter is split over TP for a tower split as ``tower_split`` says ("A", "B" or None)."""
    return {None: None, "row": "A"}.get(split, "B")


def local_factors(split: str | None, a: torch.Tensor, b: torch.Tensor, rank: int, size: int):
    """This TP rank's (A, B) of an adapter at HF shapes on a tower split ``size`` ways (``tower_split``)."""
    if size == 1 or split is None:
        return a, b
    if split == "row":
        per = a.shape[1] // size
        return a[:, rank * per:(rank + 1) * per], b
    blocks = b.reshape(3 if split == "qkv" else 1, -1, b.shape[1])
    per = blocks.shape[1] // size
    return a, blocks[:, rank * per:(rank + 1) * per].reshape(-1, b.shape[1])


def gathered_factor(split: str | None, shards: list[torch.Tensor]) -> torch.Tensor:
    """The HF-shaped split factor from the TP ranks' shards (``local_factors``' inverse)."""
    if split == "row":
        return torch.cat(shards, dim=1)
    blocks = torch.cat([s.reshape(3 if split == "qkv" else 1, -1, s.shape[1]) for s in shards], dim=1)
    return blocks.reshape(-1, blocks.shape[2])


def placed(adapter, delta: torch.Tensor, width: int, *, weight: bool = False) -> torch.Tensor:
    """An adapter's output ``[..., rows]`` (or its weight delta ``[rows, in]``) at its rows among the module's
    ``width`` outputs: its block of a fused ``qkv`` (``adapter.rows``: (start, stop)), else all of them."""
    rows = getattr(adapter, "rows", None)
    if rows is None:
        return delta
    return F.pad(delta, (0, 0) * weight + (rows[0], width - rows[1]))


class LoraVisionLinear(VisionLinear):
    """A vision tower linear plus LoRA adapters (``lora`` keyed by the HF module's name: one, or Gemma 3's q / k / v
    on a fused ``qkv``, each at its ``rows``)."""

    lora: nn.ModuleDict

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = super()._linear(x, bias)
        if self.__dict__.get("lora_disabled"):  # NOTE: inside disable_adapter() (unload.py)
            return out
        group = self.__dict__.get("lora_tp_group")  # set: the tower is split over this group
        for adapter in self.lora.values():
            a, b, row = adapter.A, adapter.B, adapter.tower_split == "row"
            if group is not None and adapter.tower_split is not None:
                # NOTE: the whole factor's gradient is partial per rank (module docstring): summed over the group
                a, b = (a, copy_to_tensor_model_parallel_region(b, group=group)) if row else \
                    (copy_to_tensor_model_parallel_region(a, group=group), b)
            xd = adapter.drop(x, input_is_split=row and group is not None)
            delta = placed(adapter, adapter.scaling * F.linear(F.linear(xd, a), b), self.out_features)
            if adapter.magnitude is not None:  # NOTE: DoRA, on a whole tower only (dora.check_tower_dora)
                from loongforge_hf.lora.dora import one_adapter_output

                return one_adapter_output(self, out, delta, None if xd is x else xd, bias)
            out = out + delta
        return out

    def lora_delta_weight(self) -> torch.Tensor:
        return sum(placed(a, a.scaling * (a.B.float() @ a.A.float()), self.out_features, weight=True)
                   for a in self.lora.values())

    def lora_merge_delta(self) -> torch.Tensor:
        """What merging adds to ``weight`` (float32): ``scaling * B @ A``, or with DoRA ``s * (W + ΔW) - W``."""
        from loongforge_hf.lora import dora

        return dora.merge_delta(self.weight, self.lora_delta_weight(), self.lora, lambda: dora.one_adapter_scale(self))


def attach_vision_adapters(model, members, *, dropout: float, dtype, device, dora: bool = False,
                           magnitudes: dict | None = None) -> None:
    """The vision targets' adapters (``members``: (target, (A, B)) at HF shapes) on this rank's tower, if any; with
    ``dora`` their magnitudes (``magnitudes`` by HF module, else the initial row norms: ``dora.add_magnitudes``)."""
    from loongforge_hf.lora.layers import LoraAdapter

    tower_chunk = model.chunks[0]
    if getattr(tower_chunk, "vision", None) is None:
        return  # another pipeline stage
    for t, _ in members:  # every target adaptable before anything changes
        if type(tower_chunk.get_submodule(t.megatron_module)) is not VisionLinear:
            raise LoraConfigError(f"{t.hf_module}: expected the tower's VisionLinear, found "
                                  f"{type(tower_chunk.get_submodule(t.megatron_module)).__name__}.")
    for t, (a, b) in members:
        module = tower_chunk.get_submodule(t.megatron_module)
        group = getattr(tower_chunk.get_submodule(t.megatron_module.rsplit(".", 1)[0]), "tp_group", None)
        split = tower_split(t) if group is not None else None
        a, b = local_factors(split, a, b, dist.get_rank(group) if split else 0, dist.get_world_size(group) if split
                             else 1)
        adapter = LoraAdapter(a.to(device=device, dtype=dtype).contiguous().clone(),
                              b.to(device=device, dtype=dtype).contiguous().clone(), scaling=t.scaling,
                              dropout=dropout, split=split_factor(split))
        adapter.tower_split = split
        if len(t.mapping.hf_names(None)) > 1:  # NOTE: Gemma 3's q / k / v: this target's block of the fused rows
            adapter.rows = (t.slot * b.shape[0], (t.slot + 1) * b.shape[0])
        if type(module) is VisionLinear:
            module.__class__ = LoraVisionLinear
            module.lora = nn.ModuleDict()
            module.lora_tp_group = group
        module.lora[t.name] = adapter
        if dora:
            from loongforge_hf.lora.dora import add_magnitudes

            add_magnitudes(module, [t], {}, magnitudes, ctx=None)
