"""``get_peft_model`` for loongforge models: LoRA adapters injected into the megatron layers, the base frozen.

Choices:
- In place, like PEFT's ``inject_adapter_in_model``: the megatron linears named by the config get adapters
  (``layers.py``), every base parameter gets ``requires_grad=False`` except those of ``modules_to_save``, and the
  model object becomes a ``LoongLoraModelForCausalLM`` (a ``LoongModelForCausalLM`` subclass: LoongTrainer trains it
  as it is; megatron's DDP and distributed optimizer skip parameters that do not require grad, so they hold, reduce
  and update only the adapters). The returned object is the model passed in.
- Initial values are PEFT's, drawn at HF shapes on every rank (``init.py``) and sliced to this rank's part; call
  ``transformers.set_seed(seed)`` first to get PEFT's numbers for that seed (LoongSFTTrainer does, as TRL does).
  Every rank draws from global rank 0's generator state (``generator_of_rank0``: set on each rank first), so a
  factor replicated over ranks is one tensor even where the script never seeded, or its ranks' generators moved
  apart (as DDP broadcasts rank 0's module to a transformers run).
  PiSSA / OLoRA (``init_lora_weights="pissa"``, ``"pissa_niter_<n>"``, ``"olora"``) decompose the base weights
  (``init.decomposed_initial_weights``, collective) and leave the residual ``W - scaling * B @ A`` in them, placed
  as the adapters are (``attach_lora``'s ``residual``): ``unload()`` / ``disable_adapter()`` then give that residual
  model, ``merge_and_unload()`` / the merged export the original weights, as PEFT's do.
- Adapter weights have the model's dtype; megatron's optimizer keeps their float32 master copies (what PEFT's
  float32 adapters on a bf16 model are for).
- ``save_pretrained(dir)`` writes a PEFT adapter folder (``peft.PeftModel.from_pretrained(hf_model, dir)`` loads it);
  ``save_pretrained(dir, merged=True)`` a plain HF checkpoint of the merged weights (``export.py``).
- Mixture-of-experts models (Qwen3-MoE, Mixtral) get the adapters PEFT gives them (``plan.py``): attention
  projections as modules, routed experts and router as parameters (``experts.py``). Attention and router adapters
  reduce over the dense data-parallel group; expert adapters are expert parameters (under expert parallelism, or
  expert_tensor_parallel_size=1 below tensor_parallel_size, megatron reduces them over the expert-data-parallel group,
  as the experts, and steps them with its expert optimizer). The routed experts alone may be adapted (PEFT's
  ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``) under any of these layouts, a
  pipeline stage training nothing dense included: megatron's dense optimizer is then a stub or holds empty groups
  on that stage, which LoongTrainer's engine and checkpoints take as they are (``trainer/optimizer_state.py``).
- More TP ranks than KV heads (each KV head replicated, ``parallel/kv_replicas.py``): ``q_proj`` and the other
  linears are adapted as usual, ``k_proj`` / ``v_proj`` with B the head's replica (its gradient summed over the
  head's ranks, ``kv_replicas.mark_adapter_replicas``), a packed q / k / v linear's (Phi-3's ``qkv_proj``, Falcon's
  ``query_key_value``, GPTBigCode's ``c_attn``) with B's rows as the weight's (``_layout_and_slices``) and its K / V
  rows marked so; adapters on a Mamba2 ``in_proj`` whose B / C rows are replicated over TP are refused
  (fewer groups than TP ranks: ``check_replicated_rows``).
- A sequence classifier (``lf.AutoModelForSequenceClassification``) becomes a
  ``LoongLoraModelForSequenceClassification``, its ``score`` head trained whole as PEFT's ``SEQ_CLS``
  (``sequence_classification.py``).
- A column-parallel linear of several HF linears (``linear_qkv``, ``linear_fc1``, the Gated DeltaNet ``in_proj``)
  holds each target's adapter in its slot of the output (``layers.FusedLayout``): the slots' rows per rank from the
  mapping (``rank_rows`` where they differ: ``in_proj_qkv`` / ``z`` / ``b`` / ``a``), each rank's B rows its block of
  B in megatron's row order (``_layout_and_slices``, ``Target.b_to_megatron``), so gradients reach each adapter only.
- With pipeline parallelism the first stage must hold something trainable (its input, the embedding, does not
  require grad, so a stage without adapters would have nothing to back-propagate into).
"""

from __future__ import annotations

import copy
import math
import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from loongforge_hf.bridges import moe_graphs
from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.gated_mappings import GatedQKV
from loongforge_hf.bridges.packed_mappings import GroupedQKV, PackedQKV
from loongforge_hf.lora import unload as unload_
from loongforge_hf.lora.plan import LoraConfigError, LoraPlan, plan_lora
from loongforge_hf.modeling import LoongModelForCausalLM

PARAM_KINDS = ("experts", "router", "shared_gate")  # adapters on raw parameters, attached by experts.py


class LoongLoraModelForCausalLM(LoongModelForCausalLM):
    """A ``LoongModelForCausalLM`` whose megatron linears carry LoRA adapters (made by ``get_peft_model``)."""

    lora_config: object
    lora_plan: LoraPlan
    lora_originals: list  # (modules_to_save parameter, its value before training): unload.py

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameters of the whole model, counted as PEFT counts them on the HF model."""
        dora = bool(self.lora_config.use_dora)  # NOTE: DoRA's magnitude: one value per output row
        trainable = sum(t.r * t.num_experts * (t.in_features + t.out_features) + dora * t.out_features
                        for t in self.lora_plan.targets)
        trainable += sum(math.prod(self.lora_plan.hf_shapes[s.hf_name]) for s in self.lora_plan.saved)
        hidden = self.lora_plan.hf_shapes[f"{self.lora_plan.embedding_name}.weight"][1]
        trainable += len(self.lora_plan.token_indices) * hidden
        return trainable, self.lora_plan.hf_param_count + trainable

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"trainable params: {trainable:,d} || all params: {total:,d} || "
                  f"trainable%: {100 * trainable / total:.4f}")

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True):
        """Refused once the vocabulary would change: resize the base model before applying LoRA, as with PEFT (the
        adapters' ``modules_to_save``, trainable token rows and files are sized at ``get_peft_model``)."""
        from loongforge_hf.bridges.vocab_resize import resized_vocab_size

        if resized_vocab_size(self.vocab_size, new_num_tokens, pad_to_multiple_of) != self.vocab_size:
            raise TypeError("resize_token_embeddings: resize the base model before applying LoRA (as with PEFT): the "
                            "adapters' modules_to_save and files are sized at get_peft_model.")
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    def merge_and_unload(self, progressbar: bool = False, safe_merge: bool = False, adapter_names=None):
        """PEFT's: the adapters merged into the base weights and removed; returns this model, now a plain
        ``LoongModelForCausalLM`` (``unload.py``)."""
        return unload_.merge_and_unload(self, safe_merge=safe_merge, adapter_names=adapter_names)

    def unload(self):
        """PEFT's: the adapters removed, not merged; returns this model, now a plain ``LoongModelForCausalLM``."""
        return unload_.unload(self)

    def disable_adapter(self):
        """PEFT's context manager: the base model's outputs inside the block (``unload.py``)."""
        return unload_.disable_adapter(self)

    def get_base_model(self):
        """PEFT's: the model under the adapters; the adapters live in this model's own layers, so itself."""
        return self

    def save_pretrained(self, save_directory: str | os.PathLike, *, merged: bool = False,
                        max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                        side_files_dir: str | os.PathLike | None = None,
                        path_initial_model_for_weight_conversion: str | os.PathLike | None = None, **unused) -> None:
        """The PEFT adapter folder (adapter tensors in ``dtype``, default the model's; one file, as PEFT writes, so
        ``max_shard_size`` only applies to the merged checkpoint), or with ``merged=True`` a plain HF checkpoint of
        the merged weights; ``side_files_dir`` as ``LoongModelForCausalLM.save_pretrained``.
        ``path_initial_model_for_weight_conversion`` (PiSSA / OLoRA, as PEFT's): the adapter folder saved right after
        ``get_peft_model``; the adapter is then written as a plain LoRA adapter of twice the rank for the original
        base model (``export.converted_to_lora``)."""
        from loongforge_hf.bridges.export_files import check_export_dtype
        from loongforge_hf.lora.export import check_convertible, export_adapter, merged_weights
        from loongforge_hf.modeling import refuse_save_options

        refuse_save_options({k: v for k, v in unused.items()
                             if (k, v) not in (("selected_adapters", None), ("selected_adapters", ["default"]),
                                               ("save_embedding_layers", "auto"))})
        initial = path_initial_model_for_weight_conversion
        if initial is not None:
            check_convertible(self, merged)
        if not merged:
            check_export_dtype(dtype)
            export_adapter(self, Path(save_directory), dtype=dtype, side_files_dir=side_files_dir,
                           initial_dir=None if initial is None else Path(initial))
            return
        with merged_weights(self):
            super().save_pretrained(save_directory, max_shard_size=max_shard_size, dtype=dtype,
                                    side_files_dir=side_files_dir)


def _layout_and_slices(target_group, ctx, layer: int):
    """(FusedLayout or None, {name: (rows or cols slice of B or A)}) for the targets sharing one megatron linear."""
    from loongforge_hf.lora.layers import FusedLayout

    first = target_group[0]
    names = [n.removesuffix(".weight").rsplit(".", 1)[-1] for n in first.mapping.hf_names(layer)]
    tp, rank = ctx.tp_size, ctx.tp_rank
    if first.kind == "replicated":  # NOTE: whole on every rank (replicated.py)
        return None, {t.name: slice(None) for t in target_group}
    if first.kind == "qkv":
        # NOTE: Gemma 4's full layers: their own head size and KV heads, and no v slot with values from keys
        ctx = first.mapping.layer_context(ctx, layer) if hasattr(first.mapping, "layer_context") else ctx
        heads, groups, hd = ctx.num_heads // tp, ctx.local_kv_heads, ctx.head_dim
        gated = isinstance(first.mapping, GatedQKV)
        # NOTE: each head's query and output gate in q_proj (Qwen3.5), or the gates an HF linear of their own beside
        # the queries (AFMoE's gate_proj: names q, k, v, gate), per KV group after its queries, as megatron holds them
        q, *kv = names[:3]
        own_gates = names[3:] if gated else []
        q_rows = (2 if gated and not own_gates else 1) * hd
        # NOTE: value heads of their own width (MiMo-V2-Flash's v_head_dim)
        widths = dict(zip(kv, (hd, getattr(first.mapping, "v_head_dim", None) or hd)))
        slots = ((q, heads // groups * q_rows), *((g, heads // groups * hd) for g in own_gates),
                 *((n, widths[n]) for n in kv))
        first_kv = ctx.first_kv_head(rank)
        return FusedLayout(groups=groups, slots=slots), {
            q: slice(rank * heads * q_rows, (rank + 1) * heads * q_rows),
            **{n: slice(first_kv * widths[n], (first_kv + groups) * widths[n]) for n in kv},
            **{g: slice(rank * heads * hd, (rank + 1) * heads * hd) for g in own_gates}}
    if first.kind in ("gated", "column") and hasattr(first.mapping, "rank_rows"):
        # NOTE: HF tensors of unequal rows in one megatron linear (the Gated DeltaNet in_proj), each rank's B rows
        # of a target a block of its megatron-ordered rows (Target.b_to_megatron)
        rows = first.mapping.rank_rows(tp)
        layout = FusedLayout(groups=1, slots=tuple(zip(names, rows)))
        return layout, {n: slice(rank * size, (rank + 1) * size) for n, size in zip(names, rows)}
    if first.kind == "column" and ctx.kv_replicas > 1 and isinstance(first.mapping, (PackedQKV, GroupedQKV)):
        # NOTE: a packed q / k / v linear with each KV head replicated (kv_replicas.py): a rank's query heads and its
        # replica's K / V rows, the weight's rows (Target.b_to_megatron replicates the head's rows)
        rows = (ctx.num_heads // tp + 2 * ctx.local_kv_heads) * ctx.head_dim
        return FusedLayout(groups=1, slots=((names[0], rows),)), {names[0]: slice(rank * rows, (rank + 1) * rows)}
    if first.kind in ("gated", "column"):
        start, stop = T.shard_range(first.out_features, rank=rank, world=tp, name=first.hf_module)
        layout = FusedLayout(groups=1, slots=tuple((n, stop - start) for n in names))
        return layout, {n: slice(start, stop) for n in names}
    start, stop = T.shard_range(first.in_features, rank=rank, world=tp, name=first.hf_module)
    return None, {names[0]: slice(start, stop)}


def _local_factors(t, a: torch.Tensor, b: torch.Tensor, slices, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of target ``t``'s HF-shaped (A, B): A's input columns of a row-parallel linear, else B's rows
    in megatron's row order (``Target.b_to_megatron``)."""
    if t.kind == "row":
        return a[:, slices[t.name]], b
    return a, t.b_to_megatron(b, ctx)[slices[t.name]]


@torch.no_grad()
def _leave_residual(weight: torch.Tensor, layout, removed: dict) -> None:
    """``weight`` (this rank's part of one megatron linear) minus ``scaling * B @ A`` of each ``removed[name] =
    (scaling, A, B)`` (this rank's slices), in float32 and cast back, as PEFT's ``pissa_init``; a fused linear's
    rows of other targets unchanged."""
    pieces = {n: (scaling * b.float().to(weight.device)) @ a.float().to(weight.device)
              for n, (scaling, a, b) in removed.items()}
    delta = next(iter(pieces.values())) if layout is None else \
        layout.interleave({n: p.t() for n, p in pieces.items()}).t()
    weight.copy_((weight.float() - delta).to(weight.dtype))


def check_stages_train(model, plan: LoraPlan, owners) -> None:
    """Refuse (every rank alike) a plan that leaves the first pipeline stage without anything to train."""
    if model.parallel.pipeline_parallel_size == 1:
        return
    first_stage = {layer for layer, (pp, _, _) in owners.items() if pp == 0}
    # NOTE: the first stage's own tensors (megatron_params_of): the embedding, GPT-2's position table
    if plan.token_indices or any(t.layer in first_stage or t.kind in ("vision", "embedding")
                                 for t in plan.targets) or any(
            s.layer in first_stage or (s.layer is None and s.mapping.megatron.startswith("embedding."))
            for s in plan.saved):
        return
    raise LoraConfigError(f"pipeline_parallel_size={model.parallel.pipeline_parallel_size}: the first pipeline stage "
                          f"(layers {sorted(first_stage)}) has no adapter, so it has nothing to train; adapt one of "
                          "its layers (layers_to_transform) or use fewer pipeline stages.")


def get_peft_model(model: LoongModelForCausalLM, peft_config) -> LoongLoraModelForCausalLM:
    """Add LoRA adapters described by ``peft_config`` (a ``peft.LoraConfig``) to ``model``, in place."""
    from loongforge_hf.bridges.builder import layer_owners
    from loongforge_hf.lora.init import decomposed_initial_weights, draw_initial_weights, is_decomposition

    plan = plan_for(model, peft_config)
    check_stages_train(model, plan, layer_owners(model.megatron.config, model.parallel))
    generator_of_rank0()
    if is_decomposition(peft_config.init_lora_weights):  # NOTE: PiSSA / OLoRA: A and B from the base weights
        initial = decomposed_initial_weights(model, plan.targets, peft_config.init_lora_weights)
        return attach_lora(model, peft_config, plan, initial, residual=initial)
    return attach_lora(model, peft_config, plan, draw_initial_weights(plan.targets, peft_config.init_lora_weights))


def generator_of_rank0() -> None:
    """Give every rank global rank 0's CPU generator state (collective; nothing on one process), so the initial
    factors each rank draws at HF shapes are rank 0's draws (module docstring): a replicated factor must be the same
    tensor on every rank, whether or not the script seeded, or seeded every rank alike."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    box = [torch.get_rng_state() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    torch.set_rng_state(box[0])


def plan_for(model: LoongModelForCausalLM, peft_config) -> LoraPlan:
    """The LoRA plan of ``peft_config`` on ``model`` (refused: a model with adapters already, or not ours)."""
    from loongforge_hf.lora.vision import LoongModelForImageTextToText, plan_image_text

    if isinstance(model, LoongLoraModelForCausalLM):
        raise LoraConfigError("This model already has LoRA adapters; apply one LoraConfig per model.")
    if type(model) is LoongModelForImageTextToText:
        return plan_image_text(model, peft_config)
    from loongforge_hf.sequence_classification import LoongModelForSequenceClassification

    if type(model) not in (LoongModelForCausalLM, LoongModelForSequenceClassification):
        raise LoraConfigError(f"LoRA applies to loongforge_hf.AutoModelForCausalLM, AutoModelForImageTextToText and "
                              f"AutoModelForSequenceClassification models, got {type(model).__name__}.")
    plan = plan_lora(model.bridge, peft_config)
    check_replicated_rows(plan, model.parallel.tensor_parallel_size)
    return plan


def check_replicated_rows(plan: LoraPlan, tensor_parallel_size: int) -> None:
    """Refuse (pure, every rank alike) an adapter on a linear whose row sections are replicated over TP (Mamba2's
    ``in_proj`` with fewer groups than TP ranks: its B / C rows on ``tp / groups`` ranks each): B's rows there would
    be replicas whose gradients are not summed."""
    replicated = [t.hf_module for t in plan.targets if getattr(t.mapping, "replicates", None) is not None
                  and t.mapping.replicates(tensor_parallel_size)]
    if replicated:
        raise LoraConfigError(
            f"LoRA on {replicated[0]}{' ...' if len(replicated) > 1 else ''}: tensor_parallel_size="
            f"{tensor_parallel_size} replicates some of its row sections (the Mamba2 groups' B / C rows: fewer groups "
            "than TP ranks), and adapters on replicated rows are not supported; exclude it (exclude_modules=["
            f"'{replicated[0].rsplit('.', 1)[-1]}']) or use a tensor_parallel_size that the groups split over.")


def attach_lora(model: LoongModelForCausalLM, peft_config, plan: LoraPlan,
                initial: list[tuple[torch.Tensor, torch.Tensor]], token_rows: torch.Tensor | None = None,
                magnitudes: dict[str, torch.Tensor] | None = None,
                residual: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> LoongLoraModelForCausalLM:
    """Adapters with the HF-shaped ``initial`` (A, B) of each target of ``plan`` (and DoRA ``magnitudes`` by HF module,
    else PEFT's initial ones), each rank keeping its slices; the base frozen but for ``modules_to_save``; the
    trainable token rows (``tokens.py``: ``token_rows``, or the embedding's own); ``model`` becomes a
    ``LoongLoraModelForCausalLM`` (in place). ``residual`` (PiSSA / OLoRA): the HF-shaped (A, B) of each target whose
    ``scaling * B @ A`` leaves its base weight (in float32, sliced and placed as the adapters are), before DoRA's
    magnitudes are taken, as PEFT's ``pissa_init`` / ``olora_init`` do."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.builder import layer_owners
    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.bridges.transforms import pad_vocab
    from loongforge_hf.lora.dora import add_magnitudes, check_tower_dora
    from loongforge_hf.lora.embedding import attach_embedding, check_embedding_adaptable, local_columns
    from loongforge_hf.lora.experts import attach_param_adapters, check_param_adaptable
    from loongforge_hf.lora.layers import FusedLayout, LoraAdapter, attach_adapters, check_adaptable, stacking
    from loongforge_hf.lora.own_weights import SPLIT_FACTOR, attach_own_weights, check_own_weights_adaptable
    from loongforge_hf.lora.replicated import attach_replicated, check_replicated_adaptable
    from loongforge_hf.lora.vision import attach_vision_adapters, lora_class_for, text_bridge
    from loongforge_hf.parallel.kv_replicas import mark_adapter_replicas

    owners = layer_owners(model.megatron.config, model.parallel)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    ctx = shard_context(text_bridge(model), tp_rank=tp_rank, tp_size=tp_size,
                        padded_vocab=model.megatron.padded_vocab)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    groups: dict[tuple[int, str], list] = defaultdict(list)
    vision = [(t, w) for t, w in zip(plan.targets, initial) if t.kind == "vision"]
    for target, weights in zip(plan.targets, initial):
        if target.kind == "vision":
            continue
        if target.kind == "embedding":  # NOTE: the first stage's (embedding.py)
            if ps.is_pipeline_first_stage(ignore_virtual=True):
                groups[(0, target.megatron_module)].append((target, weights))
            continue
        if target.kind == "head":  # NOTE: the last stage's (head.py)
            if ps.is_pipeline_last_stage(ignore_virtual=True):
                groups[(len(model.chunks) - 1, target.megatron_module)].append((target, weights))
            continue
        owner_pp, vp, local = owners[target.layer]
        if owner_pp == pp_rank:
            groups[(vp or 0, target.megatron_module.format(layer=local))].append((target, weights))

    if any(t.kind == "experts" for t in plan.targets) and ps.get_expert_tensor_parallel_world_size() != 1:
        raise LoraConfigError(f"LoRA on the routed experts needs them whole on each rank: pass "
                              f"expert_tensor_parallel_size=1 (got {ps.get_expert_tensor_parallel_world_size()}; "
                              "it defaults to tensor_parallel_size), or adapt only the attention projections.")
    if any(t.kind == "experts" for t in plan.targets) and getattr(model.megatron, "fp8", None):
        # NOTE: decided from the model, not per layer: a pipeline stage without MoE layers must refuse too
        raise LoraConfigError("LoRA on the routed experts is not supported with FP8 experts (fp8='on' / "
                              "'adaptive' or a Transformer Engine recipe); load the model without fp8, or adapt "
                              "only the attention projections.")
    from loongforge_hf.lora.tokens import check_tied_layout

    check_tied_layout(model, plan.token_indices)
    check_tower_dora(model, peft_config, plan.targets)
    for (vp, path), members in groups.items():  # every target adaptable before anything changes
        module, kind = model.chunks[vp].get_submodule(path), members[0][0].kind
        if kind in PARAM_KINDS:
            check_param_adaptable(module, kind)
        elif members[0][0].own_weight:
            check_own_weights_adaptable(module, [t for t, _ in members])
        elif kind == "embedding":
            check_embedding_adaptable(module)
        elif kind == "replicated":
            check_replicated_adaptable(module)
        else:
            check_adaptable(module)
    for p in model.parameters():
        p.requires_grad_(False)
    device, dtype = model.device, model.dtype
    stacks = stacking(plan.targets)  # NOTE: the layers each adapter is stacked over in checkpoints (layers.py)
    removed_of = {} if residual is None else {id(t): pair for t, pair in zip(plan.targets, residual)}
    for (vp, path), members in groups.items():
        targets, module = [t for t, _ in members], model.chunks[vp].get_submodule(path)
        if targets[0].kind in PARAM_KINDS:
            attach_param_adapters(module, members, dtype=dtype, device=device, dropout=float(peft_config.lora_dropout),
                                  ctx=ctx)
            continue
        if targets[0].kind == "head":  # NOTE: A whole, B's vocabulary rows of this rank (head.py)
            (t, (a, b)), = members
            per = model.megatron.padded_vocab // tp_size  # NOTE: the padded vocabulary's rows zero, as the weight's
            b = pad_vocab(b, model.megatron.padded_vocab)[tp_rank * per:(tp_rank + 1) * per]
            attach_adapters(module, {t.name: LoraAdapter(
                a.to(device=device, dtype=dtype).contiguous().clone(), b.to(device=device, dtype=dtype).clone(),
                scaling=t.scaling, dropout=float(peft_config.lora_dropout), split="B")},
                FusedLayout(groups=1, slots=((t.name, b.shape[0]),)))
            module.lora_vocab_rows = True
            continue
        if targets[0].kind == "embedding":  # NOTE: A's vocabulary columns of this rank, B whole; no dropout (PEFT's)
            attach_embedding(module, {t.name: LoraAdapter(
                local_columns(a, padded_vocab=model.megatron.padded_vocab, tp_rank=tp_rank, tp_size=tp_size).to(
                    device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).clone(),
                scaling=t.scaling, dropout=0.0, split="A") for t, (a, b) in members})
            continue
        own = targets[0].own_weight is not None  # NOTE: a bridge module's own weights, each its own split
        layout, slices = (None, {t.name: _layout_and_slices([t], ctx, t.layer)[1][t.name] for t in targets}) if own \
            else _layout_and_slices(targets, ctx, targets[0].layer)
        adapters, removed = {}, {}
        for t, (a, b) in members:
            a, b = _local_factors(t, a, b, slices, ctx)
            if id(t) in removed_of:
                removed[t.name] = (t.scaling, *_local_factors(t, *removed_of[id(t)], slices, ctx))
            adapters[t.name] = LoraAdapter(a.to(device=device, dtype=dtype).contiguous().clone(),
                                           b.to(device=device, dtype=dtype).contiguous().clone(),
                                           scaling=t.scaling, dropout=float(peft_config.lora_dropout),
                                           split=SPLIT_FACTOR.get(t.kind, "B"))
            adapters[t.name].stacked_layers, adapters[t.name].stack_suffix = stacks[(t.megatron_module, t.name, t.r)]
        if own:
            attach_own_weights(module, members, adapters)
        elif targets[0].kind == "replicated":
            attach_replicated(module, adapters)
        else:
            attach_adapters(module, adapters, layout)
        if removed:
            _leave_residual(module.weight, layout, removed)
        if peft_config.use_dora:
            add_magnitudes(module, targets, slices, magnitudes, ctx)
        if targets[0].kind in ("qkv", "column") and not own:
            mark_adapter_replicas(module, targets, tp_rank)
    attach_vision_adapters(model, vision, dropout=float(peft_config.lora_dropout), dtype=dtype, device=device,
                           dora=bool(peft_config.use_dora), magnitudes=magnitudes)

    # NOTE: modules_to_save train in place; PEFT keeps the originals (disable_adapter, unload); StableLM's per-head
    # norms are several HF tensors in one megatron tensor
    trained = {id(params[name]): params[name] for saved in plan.saved
               for params, name in megatron_params_of(model, saved, owners, pp_rank)}
    # NOTE: a tensor its bridge marks takes_no_gradient (DeepSeek-V4's, HY-V4's indexers) stays frozen: PEFT's gets none
    # there, so no update; megatron's gradient buffers expect a gradient for each trainable parameter
    originals = [(param.requires_grad_(not getattr(param, "takes_no_gradient", False)), param.detach().clone())
                 for param in trained.values()]
    if plan.token_indices:
        from loongforge_hf.lora.tokens import attach_trainable_tokens

        attach_trainable_tokens(model, plan.token_indices, token_rows)

    if moe_graphs.asked(model.megatron.config):
        # NOTE: megatron's capture warm-up takes each graphed layer's input gradient and fails where no input
        # requires grad, the first layer's behind the frozen embedding (an H200 run, 2026-11-29)
        model.embedding_output_requires_grad("cuda_graphs", True)
    model.lora_base_class = type(model)
    model.__class__ = lora_class_for(model)
    model.lora_config = copy.deepcopy(plan.config)
    model.lora_plan = plan
    model.lora_originals = originals
    return model


def megatron_params_of(model, saved, owners, pp_rank):
    """(parameters by megatron name, name) of a ``modules_to_save`` tensor on this rank (none on another stage)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.lora.vision import chunk_params

    chunks = [chunk_params(c) for c in model.chunks]
    if saved.layer is not None:
        owner_pp, vp, local = owners[saved.layer]
        if owner_pp == pp_rank:
            yield chunks[vp or 0], saved.mapping.megatron.format(layer=local)
        return
    if saved.mapping.megatron.startswith("embedding.") and ps.is_pipeline_first_stage(ignore_virtual=True):
        yield chunks[0], saved.mapping.megatron
    elif not saved.mapping.megatron.startswith("embedding.") and ps.is_pipeline_last_stage(ignore_virtual=True):
        yield chunks[-1], saved.mapping.megatron
