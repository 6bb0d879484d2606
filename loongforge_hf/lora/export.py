"""Writing a LoRA model out: a PEFT adapter folder, or the merged weights as a plain HF checkpoint.

Choices:
- Adapter folder = what ``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained(hf_model, dir)`` reads:
  ``adapter_model.safetensors`` with PEFT's names (``base_model.model.<HF module>.lora_A.weight`` / ``lora_B``, and
  ``base_model.model.<HF parameter>`` for ``modules_to_save``) at HF shapes, and ``adapter_config.json`` (the
  LoraConfig, ``target_modules`` as PEFT saves them: "all-linear" becomes the module names it matched). DoRA adds
  ``base_model.model.<HF module>.lora_magnitude_vector`` [out] per target.
- Tensors stream as the HF exporter's do: on the owning pipeline stage's first data-parallel replica, the first TP
  rank gathers a split factor's shards (concatenated along the split dim) or takes its own copy of a replicated one,
  and sends the full tensor to global rank 0 (expert stacks: each expert-parallel rank sends its experts' factors,
  ``expert_export.py``). Rank 0 holds the adapter (small) and writes through ``CheckpointWriter``: a temporary
  folder renamed into place, so an interrupted save never leaves a folder that looks complete. Failures are shared
  with every rank, which all raise the same error.
- Merged export: every adapted megatron weight (each expert of an expert stack) gets ``scaling * B @ A`` (computed
  in float32, added in the weight's dtype, as PEFT's ``merge_and_unload``; DoRA: ``dora.merge_delta``), the regular
  HF export runs, and the
  original weights are copied back from a CPU copy: the model continues unmerged, bit for bit. With PiSSA / OLoRA the
  base weights are the residual (``init.py``), so the merged weights are the original ones plus what training added.
- PiSSA / OLoRA: the adapter folder holds A and B as they are and the config's ``init_lora_weights`` as given, as
  PEFT's plain ``save_pretrained`` (loading it, PEFT and ``load.py`` decompose the original base weights again).
  ``path_initial_model_for_weight_conversion`` (PEFT's): rank 0 reads the initial adapter from that folder (saved
  right after ``get_peft_model``) and writes ``lora_A = [A; A0]``, ``lora_B = [B, -B0]`` (so ``scaling' * B' A' =
  scaling * (B A - B0 A0)``, what training added, on the original weights) with PEFT's config changes: r, the rank
  pattern and the alpha pattern doubled, ``lora_alpha`` doubled (times sqrt 2 with rsLoRA), ``init_lora_weights`` True.
  Unlike PEFT, ``modules_to_save`` and trainable token rows are written too (PEFT drops all but the LoRA factors),
  and the initial folder's adapter_config.json is left as it is (PEFT rewrites it with ``init_lora_weights=True``).
  Refused as PEFT refuses it: rsLoRA with rank / alpha patterns; refused here: DoRA (a rescaled update is no low-rank
  difference), expert stacks, ``merged=True``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from loongforge_hf.bridges.distribution import broadcast_outcome, gather_to_first, recv_tensor, send_tensor
from loongforge_hf.lora.expert_export import expert_adapter_tensors
from loongforge_hf.lora.tokens import DELTA, peft_names, tied_head_delta, vocab_resized

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _lora_deltas(model):
    """(adapted megatron weight, its float32 merge delta: ``scaling * B @ A``, DoRA's ``dora.merge_delta``) on this
    rank; collective over TP where DoRA's row norms are."""
    from loongforge_hf.lora.experts import is_param_lora
    from loongforge_hf.lora.embedding import LoraVocabParallelEmbedding
    from loongforge_hf.lora.layers import LoraColumnParallelLinear, LoraRowParallelLinear
    from loongforge_hf.lora.own_weights import LoraOwnWeights
    from loongforge_hf.lora.replicated import LoraReplicatedLinear
    from loongforge_hf.lora.vision import LoraVisionLinear

    for chunk in model.chunks:
        for module in chunk.modules():
            if isinstance(module, (LoraColumnParallelLinear, LoraRowParallelLinear, LoraVisionLinear,
                                   LoraReplicatedLinear, LoraVocabParallelEmbedding)):
                yield module.weight, module.lora_merge_delta()
            elif is_param_lora(module) or isinstance(module, LoraOwnWeights):
                yield from module.lora_deltas()


@contextlib.contextmanager
def merged_weights(model):
    """Adapted weights hold ``W + scaling * B @ A`` inside the block; the exact originals come back after it."""
    from loongforge_hf.lora.tokens import merged_token_rows

    saved = []
    try:
        with torch.no_grad():
            for weight, delta in _lora_deltas(model):
                saved.append((weight, weight.detach().to("cpu", copy=True)))
                weight.add_(delta.to(weight.dtype))
            for weight, rows, values in merged_token_rows(model):  # NOTE: PEFT's merge: index_copy of the rows
                saved.append((weight, weight.detach().to("cpu", copy=True)))
                weight.index_copy_(0, rows, values.to(weight.dtype))
        yield
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)


def adapter_config_text(model, *, converted: bool = False) -> str:
    """adapter_config.json as PEFT writes it for this model's LoraConfig (``converted``: for the plain LoRA adapter
    ``converted_to_lora`` writes, as PEFT's ``path_initial_model_for_weight_conversion``)."""
    from peft import __version__ as peft_version

    data = model.lora_config.to_dict()
    data.update(target_modules=model.lora_plan.target_modules, base_model_name_or_path=model.name_or_path or None,
                inference_mode=True, peft_version=peft_version)
    if converted:
        data.update(init_lora_weights=True, r=2 * data["r"],
                    lora_alpha=data["lora_alpha"] * (2 ** 0.5 if data.get("use_rslora") else 2),
                    rank_pattern={k: 2 * v for k, v in (data.get("rank_pattern") or {}).items()},
                    alpha_pattern={k: 2 * v for k, v in (data.get("alpha_pattern") or {}).items()})
    if data.get("task_type") is None:
        # NOTE: what PeftModel.save_pretrained adds without a task type (the base model's class): peft's
        # AutoPeftModel loads the base by it; the config's architecture where Auto does not map it (Mistral 4)
        import transformers

        from loongforge_hf.lora.plan import unmapped_class
        from loongforge_hf.lora.vision import LoongModelForImageTextToText

        auto = transformers.AutoModelForImageTextToText if isinstance(model, LoongModelForImageTextToText) \
            else transformers.AutoModelForCausalLM
        hf_class = unmapped_class(model.config, auto) or auto._model_mapping[type(model.config)]
        data["auto_mapping"] = {"base_model_class": hf_class.__name__, "parent_library": hf_class.__module__}

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return json.dumps(plain(data), indent=2, sort_keys=True) + "\n"


class _Streamer:
    """Moves full HF tensors from their owning ranks to global rank 0 (collective: every rank runs every call)."""

    def __init__(self, model) -> None:
        from megatron.core import parallel_state as ps

        from loongforge_hf.bridges.builder import layer_owners
        from loongforge_hf.bridges.loader import shard_context
        from loongforge_hf.lora.vision import chunk_params, text_bridge

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.replica0 = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        self.pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) \
            if dist.is_initialized() else [0]
        self.owners = layer_owners(model.megatron.config, model.parallel)
        self.last_pp = model.parallel.pipeline_parallel_size - 1
        self.ctx = shard_context(text_bridge(model), tp_rank=self.tp_rank,
                                 tp_size=ps.get_tensor_model_parallel_world_size(),
                                 padded_vocab=model.megatron.padded_vocab)
        self.params = [chunk_params(chunk) for chunk in model.chunks]
        self.device = model.device

    def owner_of(self, layer: int | None, megatron_name: str) -> tuple[int, int, str]:
        """(pipeline rank, chunk index, local megatron name) of a tensor named with ``{layer}``."""
        if layer is not None:
            pp, vp, local = self.owners[layer]
            return pp, vp or 0, megatron_name.format(layer=local)
        if megatron_name.startswith(("embedding.", "vision.")):  # NOTE: the vision tower: first stage
            return 0, 0, megatron_name
        return self.last_pp, len(self.params) - 1, megatron_name

    def collect(self, owner_pp: int, vp: int, name: str, *, split: bool, export, shapes: dict[str, tuple], dtype):
        """{hf name: tensor} on rank 0 (empty elsewhere). ``export(shards)`` turns the TP shards (``split``) or the
        first TP rank's copy (replicated) into HF tensors."""
        holds = owner_pp == self.pp_rank and self.replica0
        full: dict[str, torch.Tensor] = {}
        if holds:
            local = self.params[vp][name].detach()
            shards = gather_to_first(local, group=self.tp_group) if split else [local]
            if self.tp_rank == 0:
                full = export(shards)
        if self.rank == 0:
            if holds:
                return {n: t.to("cpu", dtype) for n, t in full.items()}
            src = self.pp_ranks[owner_pp]
            return {n: recv_tensor(shapes[n], dtype, src=src, device=self.device).cpu() for n in shapes}
        if holds and self.tp_rank == 0:
            for n in shapes:
                send_tensor(full[n].to(dtype), dst=0)
        return {}


def _adapter_tensors(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every adapter tensor at HF shape on rank 0 (empty dict elsewhere), in ``dtype`` (default the model's);
    collective."""
    from loongforge_hf.lora.vision import gathered_factor, split_factor, tower_split

    plan, streamer, dtype = model.lora_plan, _Streamer(model), dtype or model.dtype
    split_tower = getattr(model, "vision_layout", None) == "tensor_parallel"
    out: dict[str, torch.Tensor] = {}
    for t in plan.targets:
        if t.kind == "experts":  # below, all at once
            continue
        prefix = f"base_model.model.{t.hf_module}"
        base = t.megatron_module + f".lora.{t.name}"
        split, kind = {"row": "A", "router": None, "shared_gate": None, "replicated": None,
                       "embedding": "A"}.get(t.kind, "B"), None
        if t.kind == "vision":  # NOTE: whole unless the tower is split (lora/vision.py)
            kind = tower_split(t) if split_tower else None
            split = split_factor(kind)
        factors = [("A", 1 if split == "A" else None), ("B", 0 if split == "B" else None)]
        names = dict(zip("AB", (f"{prefix}.{f}" for f in t.file_factors)))
        if plan.config.use_dora:  # NOTE: DoRA's magnitude: split over TP as B's rows are, else replicated
            factors.append(("magnitude", 0 if split == "B" else None))
        for factor, split_dim in factors:
            hf_name = f"{prefix}.lora_magnitude_vector" if factor == "magnitude" else names[factor]
            shape = {"A": t.a_shape, "B": t.b_shape, "magnitude": (t.out_features,)}[factor]
            owner_pp, vp, name = streamer.owner_of(t.layer, f"{base}.{factor}")
            to_hf = {"B": lambda b, t=t: t.b_to_hf(b, streamer.ctx),
                     "magnitude": lambda m, t=t: t.b_to_hf(m[:, None], streamer.ctx)[:, 0]}.get(factor)
            if t.kind == "embedding":  # NOTE: A's padded vocabulary trimmed; B as it is
                to_hf = (lambda a, t=t: a[:, :t.in_features]) if factor == "A" else None
            if t.kind == "head":  # NOTE: B's padded vocabulary trimmed; A as it is
                to_hf = (lambda b, t=t: b[:t.out_features]) if factor == "B" else None

            # NOTE: K / V adapters on replicated KV heads: each head's B from its first replica (kv_replicas.py)
            step = streamer.ctx.kv_replicas if t.kind == "qkv" and t.slot > 0 and factor != "A" else 1

            def export(shards, hf_name=hf_name, split_dim=split_dim, to_hf=to_hf, vision=kind, step=step):
                full = shards[0] if split_dim is None else gathered_factor(vision, shards) if vision else \
                    torch.cat(shards[::step], dim=split_dim)
                return {hf_name: full if to_hf is None else to_hf(full)}
            out.update(streamer.collect(owner_pp, vp, name, split=split_dim is not None, export=export,
                                        shapes={hf_name: shape}, dtype=dtype))
    out.update(expert_adapter_tensors(model, plan.targets, streamer, dtype))
    whole = [(s, f"base_model.model.{s.hf_name}") for s in plan.saved]
    tied, resized = model.bridge.tied, vocab_resized(model)
    names = peft_names(plan, tied)
    # NOTE: with LoRA on the embedding or the LM head PEFT writes the base weight of each adapted one
    # (save_embedding_layers="auto"), not the other's
    adapted = adapted_vocabulary(plan)
    if resized or adapted:
        wanted = adapted or set(names)
        carried = vocabulary_tensors(model, wanted - {s.hf_name for s in plan.saved})
        whole += [(s, names[s.hf_name]) for s in carried]
    by_tensor: dict = {}  # NOTE: one collect a megatron tensor (StableLM's per-head norms: an HF tensor per head)
    for s, hf_name in whole:
        by_tensor.setdefault((s.layer, s.mapping.megatron), []).append((s, hf_name))
    for (layer, megatron), members in by_tensor.items():
        owner_pp, vp, name = streamer.owner_of(layer, megatron)
        mapping = members[0][0].mapping

        def export(shards, mapping=mapping, layer=layer, members=members):
            tensors = mapping.export(shards, streamer.ctx, layer)
            return {hf_name: tensors[s.checkpoint_name] for s, hf_name in members}
        out.update(streamer.collect(owner_pp, vp, name, split=mapping.tp_split is not None, export=export,
                                    shapes={hf_name: plan.hf_shapes[s.hf_name] for s, hf_name in members},
                                    dtype=dtype))
    if tied and resized and not adapted and streamer.rank == 0:
        embedding = out.get(names[f"{plan.embedding_name}.weight"])
        if embedding is not None:  # NOTE: PEFT writes the tied LM head under its own name too
            out[names["lm_head.weight"]] = embedding.clone()  # NOTE: safetensors refuses shared storage
    if plan.token_indices:
        hf_name = f"base_model.model.{plan.embedding_name}.{DELTA}"
        shape = (len(plan.token_indices), model.config.hidden_size)
        out.update(streamer.collect(0, 0, f"embedding.{DELTA}", split=False, export=lambda shards: {hf_name: shards[0]},
                                    shapes={hf_name: shape}, dtype=dtype))
        head_delta = tied_head_delta(plan, tied, resized)
        if head_delta is not None and hf_name in out:
            out[head_delta] = out[hf_name].clone()
    return out


def check_convertible(model, merged: bool) -> None:
    """``save_pretrained(path_initial_model_for_weight_conversion=...)`` refused (``ValueError``, on every rank alike,
    before anything is written) where the conversion cannot hold the adapter."""
    config = model.lora_config
    if merged:
        raise ValueError("save_pretrained(merged=True) writes the merged weights; path_initial_model_for_weight_"
                         "conversion converts an adapter folder: pass one or the other.")
    if config.use_rslora and (config.rank_pattern or config.alpha_pattern):
        raise ValueError("Passing `path_initial_model_for_weight_conversion` to `save_pretrained` is not supported "
                         "when using `rank_pattern` or `alpha_pattern` at the same time as `use_rslora=True`.")
    if config.use_dora:
        raise ValueError("path_initial_model_for_weight_conversion: a DoRA adapter (use_dora=True) rescales the whole "
                         "weight, so its update is no low-rank difference; save the adapter as it is, or the merged "
                         "weights (merged=True).")
    if any(t.num_experts > 1 for t in model.lora_plan.targets):
        raise ValueError("path_initial_model_for_weight_conversion is not supported with adapters on expert stacks "
                         "(their factors hold every expert's rank; doubling them would mix the experts' rows).")


def converted_to_lora(tensors: dict[str, torch.Tensor], initial_dir: Path) -> dict[str, torch.Tensor]:
    """The adapter ``tensors`` as a plain LoRA adapter of twice the rank for the original base weights (PEFT's
    ``subtract_mutated_init``): ``[A; A0]`` and ``[B, -B0]`` with (A0, B0) from the adapter folder ``initial_dir``
    saved right after ``get_peft_model``; the other tensors as they are."""
    from safetensors.torch import load_file

    path = initial_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"path_initial_model_for_weight_conversion={os.fspath(initial_dir)!r} has no "
                                f"{ADAPTER_WEIGHTS}: pass the adapter folder saved (save_pretrained) right after "
                                "get_peft_model, before training.")
    initial = load_file(str(path))
    out = {}
    for name, tensor in tensors.items():
        factor = "A" if name.endswith(".lora_A.weight") else "B" if name.endswith(".lora_B.weight") else None
        if factor is None:
            out[name] = tensor
            continue
        start = initial.get(name)
        if start is None or start.shape != tensor.shape:
            raise ValueError(f"the initial adapter at {os.fspath(initial_dir)!r} does not match this one: {name} is "
                             f"{'missing' if start is None else tuple(start.shape)} there, {tuple(tensor.shape)} "
                             "here.")
        start = start.to(tensor.dtype)
        out[name] = torch.cat([tensor, start], dim=0) if factor == "A" else torch.cat([tensor, -start], dim=1)
    return out


def adapted_vocabulary(plan) -> set[str]:
    """The HF tensors of the embedding layers with a LoRA adapter (the input embedding, the LM head with its bias
    where it has one), whose base tensors PEFT's adapter file carries."""
    names = {f"{plan.embedding_name}.weight"} if any(t.kind == "embedding" for t in plan.targets) else set()
    return names | ({"lm_head.weight", "lm_head.bias"} if any(t.kind == "head" for t in plan.targets) else set())


def vocabulary_tensors(model, hf_names: set[str]) -> list:
    """The embedding and an untied LM head among ``hf_names`` as ``SavedTensor`` entries (whole tensors an adapter
    file carries when the vocabulary was resized: ``tokens.py``; a tied LM head has no tensor of its own)."""
    from loongforge_hf.lora.plan import SavedTensor

    from loongforge_hf.lora.vision import text_bridge

    mappings = [text_bridge(model).embedding_mapping(), *text_bridge(model).final_mappings()]
    return [SavedTensor(hf_name=m.hf, mapping=m, layer=None) for m in mappings if m.hf in hf_names]


def export_adapter(model, out_dir: Path, *, dtype: torch.dtype | None = None,
                   side_files_dir: str | os.PathLike | None = None, initial_dir: Path | None = None) -> None:
    """Write ``model``'s adapters as a PEFT adapter folder (collective; rank 0 writes, atomically), with the files of
    ``side_files_dir`` (read on rank 0). The folder's other files are kept, as PEFT's save_pretrained keeps them (an
    old ``adapter_model.bin`` goes). ``initial_dir``: converted to a plain LoRA adapter (``converted_to_lora``)."""
    from loongforge_hf.bridges.export_files import copy_folder_into
    from safetensors.torch import save_file

    from loongforge_hf.bridges.writer import CheckpointWriter

    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = CheckpointWriter(out_dir, carry_over=lambda name: name != "adapter_model.bin")
    error: str | None = None
    if rank == 0:
        try:
            writer.__enter__()
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            error = f"{type(e).__name__}: {e}"
    error = broadcast_outcome(error, src=0)
    if error is not None:
        raise RuntimeError(f"save_pretrained({os.fspath(out_dir)!r}) failed; nothing was written: {error}")
    tensors = _adapter_tensors(model, dtype)
    if rank == 0:
        try:
            if initial_dir is not None:
                tensors = converted_to_lora(tensors, initial_dir)
            with tempfile.TemporaryDirectory(prefix="loongforge-adapter-") as tmp:
                path = Path(tmp) / ADAPTER_WEIGHTS
                save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata={"format": "pt"})
                writer.copy_file(ADAPTER_WEIGHTS, path)
            writer.write_text(ADAPTER_CONFIG, adapter_config_text(model, converted=initial_dir is not None))
            if side_files_dir is not None:
                copy_folder_into(writer, side_files_dir)
            writer.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            error = f"{type(e).__name__}: {e}"
            writer.__exit__(type(e), e, None)
    error = broadcast_outcome(error, src=0)
    if error is not None:
        raise RuntimeError(f"save_pretrained({os.fspath(out_dir)!r}) failed; nothing was written: {error}")
