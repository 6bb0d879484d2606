"""DoRA (``LoraConfig(use_dora=True)``) on megatron's tensor-parallel linears: PEFT's math, split as the weight is.

Choices:
- PEFT's DoRA (``peft.tuners.lora.dora.DoraLinearLayer``): each adapted HF linear gets a magnitude vector ``m`` (one
  value per output row, initialised to the row norms of ``W + scaling * B @ A``) and outputs
  ``W x + (s - 1) * (W x) + s * scaling * B A x`` with ``s = m / ||W + scaling * B @ A||`` per output row, the norm
  detached from the graph (section 4.3 of the paper), the bias left out of the rescaling. With ``lora_dropout``
  active PEFT rescales ``W`` applied to the dropped input instead (one more product per target); so does this.
- Column-parallel linears (``linear_qkv``, ``linear_fc1``, the plain column ones) hold whole rows: the norm of each
  local row is local, and ``m`` is split over TP like B's rows (q / k / v and gate / up each have their own ``m``
  over their rows of the fused output; rows of targets not adapted keep ``s = 1``). Row-parallel linears
  (``linear_proj``, ``linear_fc2``) hold a slice of each row: the squared row norms are summed over the TP group
  (an all-reduce, no gradient), ``m`` is replicated and enters through ``copy_to_tensor_model_parallel_region`` so
  its gradient, partial per rank like B's, is summed; the rescaled term is linear in the rank's partial output, so
  it is added before megatron's reduction.
- The output is computed as ``s * (W x + scaling * B A x) + bias``: one product with ``s`` where the formula above
  takes two (without dropout; with it, as above). The row norms are computed without the ``out x in`` matrix
  ``W + scaling * B @ A`` (PEFT builds it every forward): ``||W_i||^2 + 2 (B' * W A^T)_i 1 + (B' A A^T * B')_i 1``
  in float32 with ``B' = scaling * B``, from a reduction over W and ``out x r`` products, all targets of a fused
  linear at once (their A stacked, their B' placed block-diagonally), so the number of kernels does not grow with
  the targets.
- Without gradients (evaluation, ``generate``) the rows' squared norms of a layer are kept while its weight, A and
  B are the same tensors with the same version counters (PEFT's opt-in ``ENABLE_DORA_CACHING``, here always on in
  that mode), so a decode step does not read each adapted weight twice more; a row-parallel layer still sums its
  squares over TP every call (no rank can skip a collective another one runs). With gradients they are recomputed.
- Merging (``merge_and_unload``, the merged export) writes ``s * (W + scaling * B @ A)``, ``s`` from the unmerged
  weight, as PEFT's ``merge_safe``.
- Refused as PEFT refuses it: DoRA on ``target_parameters`` (expert stacks, router). Refused here: the vision tower
  of image-text models split over tensor parallelism (``one_adapter_output`` covers a whole tower's linears
  as it covers row-parallel ones), and Gemma 3's SigLIP q / k / v (three HF linears in one fused tower linear).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def check_dora(config, targets) -> None:
    """Refuse DoRA on targets it does not cover (``LoraConfigError``), before anything changes."""
    from loongforge_hf.lora.plan import LoraConfigError

    if not config.use_dora:
        return
    gates = sorted({t.hf_module for t in targets if t.kind == "shared_gate"})
    if gates:
        raise LoraConfigError(f"use_dora=True on shared_expert_gate ({gates[:2]} ...) is not supported (megatron keeps "
                              "that gate as a raw [1, H] weight beside the shared expert): leave it out, e.g. "
                              "exclude_modules=['shared_expert_gate'], or use plain LoRA there.")
    fused = sorted({t.hf_module for t in targets if t.kind == "vision" and len(t.mapping.hf_names(None)) > 1})
    if fused:
        raise LoraConfigError(f"use_dora=True on {fused[:2]} ... is not supported: the vision tower holds these "
                              "q / k / v projections as one fused linear (Gemma 3's SigLIP); leave them out, e.g. "
                              "target_modules=r'.*language_model.*(q|k|v|o)_proj', or use plain LoRA there.")
    params = sorted({t.hf_module for t in targets if t.kind in ("experts", "router")})
    if params:
        raise LoraConfigError(f"use_dora=True: DoRA does not apply to target_parameters ({params[:3]}; PEFT's "
                              "ParamWrapper refuses it too, and PEFT turns MoE expert and router names into such "
                              "targets): adapt the attention projections only, or use plain LoRA.")


def check_tower_dora(model, config, targets) -> None:
    """DoRA on the vision tower needs it whole on each rank (the default; encoder data parallelism too)."""
    from loongforge_hf.lora.plan import LoraConfigError

    tower = sorted({t.hf_module for t in targets if t.kind == "vision"})
    if config.use_dora and tower and getattr(model, "vision_layout", None) == "tensor_parallel":
        raise LoraConfigError(f"use_dora=True on the vision tower ({tower[:2]} ...) is not supported with the tower "
                              "split over tensor parallelism (vision_tensor_parallel_size > 1): load it whole, or "
                              "restrict target_modules to the language model (a regex on 'model.language_model').")


def one_adapter_output(module, out: torch.Tensor, delta: torch.Tensor, dropped_x, bias) -> torch.Tensor:
    """The DoRA output of a linear with one adapter (row-parallel, or a whole vision-tower linear): ``out`` its base
    output (``bias`` included if not None), ``delta`` the adapter's term, ``dropped_x`` the dropped input where
    dropout ran (else None)."""
    scale = one_adapter_scale(module)
    if dropped_x is not None:  # NOTE: PEFT's DoRA rescales W applied to the dropped input then
        return out + rescaled(delta, F.linear(dropped_x, module.weight.detach()), scale)
    return rescaled_output(out, delta, scale, bias)


def _tp_group(module):
    """The group a layer's input columns are split over (a row-parallel linear's), or None (whole rows)."""
    group = getattr(module, "tp_group", None)
    return group if group is not None and group.size() > 1 else None


def _squares(module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||W + B' A||^2 of each local row of ``module``'s weight W [rows, in], from ||W||^2, ``W A^T`` and ``A A^T``
    (``a`` [R, in]: the targets' A stacked; ``b`` [rows, R]: each row's B' = scaling * B in its target's columns)."""
    weight = module.weight.detach()
    a = a.to(weight.dtype)
    wa = (weight @ a.t()).float()
    a = a.float()
    w_squares = torch.linalg.vector_norm(weight, dim=1, dtype=torch.float32).square()
    return w_squares + 2 * (wa * b).sum(dim=1) + ((b @ (a @ a.t())) * b).sum(dim=1)


def _kept(module, compute) -> torch.Tensor:
    """``compute()`` (run without grad); when the caller runs without grad mode, the value of the last such call while
    the layer's weight and factors are the same tensors, unchanged (data pointers and version counters)."""
    if torch.is_grad_enabled():
        module.__dict__.pop("dora_squares", None)
        with torch.no_grad():
            return compute()
    tensors = [module.weight] + [t for a in module.lora.values() for t in (a.A, a.B)]
    key = tuple((t.data_ptr(), t._version) for t in tensors)
    kept = module.__dict__.get("dora_squares")
    if kept is None or kept[0] != key:
        kept = (key, compute())
        module.__dict__["dora_squares"] = kept
    return kept[1]


def _column_norms(module) -> dict[str, torch.Tensor]:
    """||W + scaling * B @ A|| of each local output row of each target of a LoRA column-parallel linear (float32)."""
    squares = _kept(module, lambda: _column_squares(module))
    return {name: module.lora_layout.slot(squares, name).sqrt() for name in module.lora}


def _column_squares(module) -> torch.Tensor:
    layout, adapters = module.lora_layout, list(module.lora.items())
    ranks = [a.A.shape[0] for _, a in adapters]
    total, before = sum(ranks), 0
    placed = {}
    for (name, a), r in zip(adapters, ranks):  # NOTE: B' in its target's rows and columns, zeros elsewhere
        placed[name] = F.pad(a.B.detach().float() * a.scaling, (before, total - before - r)).t()
        before += r
    return _squares(module, torch.cat([a.A.detach() for _, a in adapters]), layout.interleave(placed).t())


def _one_adapter_norms(module) -> torch.Tensor:
    """The same for a linear with one adapter: a row-parallel one, whose rows are split over TP (squares summed over
    the group), or a whole vision-tower linear."""
    (a,) = module.lora.values()
    squares = _kept(module, lambda: _squares(module, a.A.detach(), a.B.detach().float() * a.scaling))
    group = _tp_group(module)
    if group is not None:
        squares = squares.clone()
        dist.all_reduce(squares, group=group)
    return squares.sqrt()


def column_scale(module) -> torch.Tensor:
    """``s = m / ||W + ΔW||`` over the fused local output rows (1 where no target is adapted)."""
    norms = _column_norms(module)
    return module.lora_layout.interleave({n: a.magnitude / norms[n].to(a.magnitude.dtype)
                                          for n, a in module.lora.items()}, fill=1.0)


def one_adapter_scale(module) -> torch.Tensor:
    """``s`` over the (whole) output rows of a linear with one adapter; a row-parallel one's m gradient summed over
    TP."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    (adapter,) = module.lora.values()
    m, group = adapter.magnitude, _tp_group(module)
    if group is not None:
        m = copy_to_tensor_model_parallel_region(m, group=group)
    return m / _one_adapter_norms(module).to(m.dtype)


def rescaled(delta: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DoRA's addition to the base output: ``(s - 1) * W x + s * delta`` (``delta``: scaling * B A x)."""
    return (scale - 1) * base + scale * delta


def rescaled_output(out: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """The DoRA layer's output from the base output ``out`` (``bias`` included if not None): the same as
    ``out + rescaled(delta, out - bias, scale)``, as ``s * (W x + delta) + bias``."""
    if bias is None:
        return (out + delta) * scale
    return (out - bias + delta) * scale + bias


@torch.no_grad()
def merge_delta(weight: torch.Tensor, lora_delta: torch.Tensor, adapters, scale) -> torch.Tensor:
    """What merging adds to ``weight`` (float32): ``lora_delta``, or with DoRA ``s * (W + lora_delta) - W``
    (``scale()`` gives ``s``)."""
    if next(iter(adapters.values())).magnitude is None:
        return lora_delta
    w = weight.float()
    return (w + lora_delta) * scale().float()[:, None] - w


def add_magnitudes(module, targets, slices: dict[str, slice], given: dict[str, torch.Tensor] | None, ctx) -> None:
    """Give each adapter of ``module`` its DoRA magnitude: this rank's part of ``given`` (HF-shaped [out], by HF
    module name: a loaded adapter; ``ctx``: the ``ShardContext``) or, as PEFT initialises it, the row norms of
    ``W + scaling * B @ A``."""
    from loongforge_hf.lora.layers import LoraColumnParallelLinear

    column = isinstance(module, LoraColumnParallelLinear)
    norms = None if given else _column_norms(module) if column else _one_adapter_norms(module)  # NOTE: column: dict
    for t in targets:
        if given:
            m = given[t.hf_module].float()
            m = t.b_to_megatron(m[:, None], ctx)[slices[t.name], 0] if column else m
        else:
            m = norms[t.name] if column else norms
        adapter = module.lora[t.name]
        adapter.add_magnitude(m.to(device=adapter.A.device, dtype=adapter.A.dtype).contiguous().clone(),
                              split=column)
