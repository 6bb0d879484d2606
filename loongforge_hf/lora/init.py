"""The initial A and B of every adapter, as PEFT makes them, at HF shapes.

Choices:
- PEFT creates, per target module in ``named_modules`` order, ``lora_A = nn.Linear(in, r, bias=False)`` then
  ``lora_B = nn.Linear(r, out, bias=False)`` (each constructor draws its default kaiming-uniform init from the CPU
  generator), then re-initialises A (kaiming-uniform with ``a=sqrt(5)``, or normal with std 1/r for ``"gaussian"``)
  and zeroes B; with ``init_lora_weights=False`` both constructor draws are kept. The same calls, in the same order,
  on the CPU generator, give the same numbers: after ``transformers.set_seed(seed)`` (which TRL's SFTTrainer calls
  right before ``get_peft_model``) the first loss equals PEFT's. tests/integrations/test_lora.py checks the tensors
  against ``peft.get_peft_model`` on the HF model.
- ``"orthogonal"`` (PEFT's ``orthogonal_init``): after both constructor draws, a random ``r x r`` matrix's Q factor;
  A from its odd rows, B from its even rows (so ``B @ A = 0``), each times a fresh Gaussian, over 10. As PEFT, an odd
  rank is refused; on expert stacks and the router (PEFT's ``ParamWrapper``) it is refused here.
- The token embedding's (PEFT's ``lora.Embedding``): ``torch.randn`` of A ``[r, vocab]`` then B ``[hidden, r]``; unless
  ``init_lora_weights=False``, A zeroed and B drawn again from a standard normal (any other init, as PEFT's
  ``reset_lora_parameters`` for embeddings).
- Every rank draws every adapter of the model (all layers, full HF shapes), so the generator stays in step across
  ranks and each rank slices its own part afterwards; adapters are small next to the model.
- ``"pissa"``, ``"pissa_niter_<n>"``, ``"olora"`` (PEFT's ``pissa_init`` / ``olora_init``; ``decomposed_initial_
  weights``): A and B come from each target's base weight W (float32, HF shape [out, in]). PiSSA: ``W = V S Uh``
  (``torch.linalg.svd``), the top r kept, ``S_r /= scaling``, ``A = diag(sqrt(S_r)) Uh_r``, ``B = V_r
  diag(sqrt(S_r))``; ``pissa_niter_<n>``: the same from ``torch.svd_lowrank(W, r, niter=n)``. OLoRA: ``Q, R =
  qr(W)``, ``A = R[:r]``, ``B = Q[:, :r]``. The base weight becomes the residual ``W - scaling * B @ A`` (float32,
  cast back to its dtype), placed in megatron's fused / split weights as the adapters are (``model.attach_lora``'s
  ``residual``), so ``W_res + scaling * B @ A`` (the merged export, ``merge_and_unload``) is W again.
- W comes from the model itself, not the checkpoint (it may have been changed since loading): each TP group
  all-gathers the megatron weight holding a target and turns it back into HF tensors with the bridge mapping's own
  ``export`` (what the HF exporter does), so the decomposition sees exactly PEFT's W (a ``Conv1D`` weight, stored
  ``[in, out]``, transposed to ``[out, in]`` as PEFT's ``fan_in_fan_out`` does). The targets of a pipeline
  stage are dealt round-robin over the stage's ranks (TP x DP x CP), each decomposes its share on the model's device
  and broadcasts A and B over the stage: every rank gets the same factors, computed once. On the CPU (the tests)
  LAPACK gives PEFT's singular vectors, signs included, bit for bit; on a GPU the factors are those of cuSOLVER (a
  singular vector's sign may differ from a CPU run, B @ A does not).
- PEFT's generator use is kept: both constructor draws per target still happen, and ``svd_lowrank``'s Gaussian test
  matrix (``min(out, in) x r``) is drawn from the CPU generator at its place in that order (the state is recorded
  and replayed by the rank decomposing that target, which runs ``svd_lowrank`` on the CPU, as PEFT on a CPU model):
  ``pissa_niter_<n>`` gives PEFT's factors (within 2.3e-7 in the tests: BLAS's products there depend on the
  input's memory alignment) and the generator ends where PEFT leaves it.
- Refused (``check_decomposition``): these inits on expert stacks / the router (PEFT's ``ParamWrapper`` has no
  ``weight`` to decompose), Qwen2-MoE's shared-expert gate, the vision tower of image-text models, and an r above
  ``min(in, out)`` of a target (PEFT then silently makes a smaller adapter than the config says).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from loongforge_hf.lora.plan import LoraConfigError


def draw_initial_weights(targets, init_lora_weights) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A [r, in], B [out, r]) in float32 for each target, in order, from the default CPU generator (an expert stack's
    A [r * E, in], B [out, r * E], as PEFT's ``ParamWrapper``; the gaussian std stays 1 / r)."""
    out = []
    if init_lora_weights == "orthogonal":
        odd = sorted({t.hf_module for t in targets if t.r % 2 and t.kind != "embedding"})
        params = sorted({t.hf_module for t in targets if t.kind in ("experts", "router", "shared_gate")})
        if odd or params:
            raise LoraConfigError(f"init_lora_weights='orthogonal' needs an even rank (PEFT refuses an odd one) on "
                                  f"linear targets; {odd[:3] or params[:3]} "
                                  f"{'have an odd r' if odd else 'are expert / router parameters'}.")
    for t in targets:
        if t.kind == "embedding":  # NOTE: PEFT's lora.Embedding: randn A, B; unless False, A zeroed, B normal
            a, b = torch.randn(t.a_shape), torch.randn(t.b_shape)
            if init_lora_weights is not False:
                nn.init.zeros_(a)
                nn.init.normal_(b)
            out.append((a, b))
            continue
        lora_a, lora_b = _constructed(t)
        in_features, out_features = t.a_shape[1], t.b_shape[0]
        with torch.no_grad():
            if init_lora_weights is True:
                nn.init.kaiming_uniform_(lora_a.weight, a=math.sqrt(5))
                nn.init.zeros_(lora_b.weight)
            elif init_lora_weights == "gaussian":
                nn.init.normal_(lora_a.weight, std=1 / t.r)
                nn.init.zeros_(lora_b.weight)
            elif init_lora_weights == "orthogonal":
                q, _ = torch.linalg.qr(torch.randn(t.r, t.r))
                lora_a.weight = nn.Parameter(torch.randn(in_features, t.r // 2).mm(q[0::2, :]).T / 10.0)
                lora_b.weight = nn.Parameter(torch.randn(t.r // 2, out_features).T.mm(q[1::2, :]) / 10.0)
        out.append((lora_a.weight.detach().contiguous(), lora_b.weight.detach().contiguous()))
    return out


def _constructed(t) -> tuple[nn.Linear, nn.Linear]:
    """PEFT's ``lora_A`` / ``lora_B`` of target ``t`` as constructed (their default init drawn from the CPU
    generator)."""
    (rows, in_features), (out_features, cols) = t.a_shape, t.b_shape
    return (nn.Linear(in_features, rows, bias=False, device="cpu", dtype=torch.float32),
            nn.Linear(cols, out_features, bias=False, device="cpu", dtype=torch.float32))


# ----------------------------------------------------------------------------------------- PiSSA / OLoRA

def _niter(init) -> int | None:
    match = re.fullmatch(r"pissa_niter_(\d+)", init) if isinstance(init, str) else None
    return None if match is None else int(match.group(1))


def refuse_unverified(config, hit: list[str], where: str, leave_out: str, extra: tuple[str, ...] = ()) -> None:
    """Refuse DoRA, PiSSA / OLoRA and ``extra`` (what the caller saw asked) with LoRA on ``hit`` (the HF modules of
    one kind: ``where`` names them, ``leave_out`` how to drop them), not compared with PEFT there (pure)."""
    asked = [f"use_dora={config.use_dora}"] if config.use_dora else []
    if is_decomposition(config.init_lora_weights):
        asked.append(f"init_lora_weights={config.init_lora_weights!r}")
    asked += extra
    if hit and asked:
        raise LoraConfigError(f"{' and '.join(asked)} with LoRA on {where} {hit} is not supported (not compared with "
                              f"PEFT there); leave {leave_out} out of target_modules or drop "
                              f"{asked[0].split('=')[0]}.")


def is_decomposition(init) -> bool:
    """Whether ``init_lora_weights`` takes A and B from the base weight and leaves the residual there ("pissa",
    "pissa_niter_<n>", "olora", spelt as PEFT accepts them)."""
    return isinstance(init, str) and (init == "pissa" or init.lower() == "olora" or _niter(init) is not None)


def check_decomposition(init, targets) -> None:
    """``LoraConfigError`` for targets PiSSA / OLoRA do not cover here (before anything changes)."""
    if not is_decomposition(init):
        return
    for kinds, what in ((("experts", "router"), "expert stacks / the router, which PEFT adapts as target_parameters "
                         "(its ParamWrapper has no weight to decompose)"),
                        (("shared_gate",), "Qwen2-MoE's shared_expert_gate (megatron keeps it as a raw gate "
                         "parameter)"),
                        (("vision",), "the vision tower of an image-text model")):
        hit = sorted({t.hf_module for t in targets if t.kind in kinds})
        if hit:
            raise LoraConfigError(f"init_lora_weights={init!r} is not supported on {what}: {hit[:3]}"
                                  f"{' ...' if len(hit) > 3 else ''}; leave them out (target_modules / "
                                  "exclude_modules) or use another init_lora_weights.")
    big = [t for t in targets if t.r > min(t.in_features, t.out_features)]
    if big:
        t = big[0]
        raise LoraConfigError(f"init_lora_weights={init!r}: r={t.r} exceeds min(in, out) = "
                              f"{min(t.in_features, t.out_features)} of {t.hf_module} ({len(big)} target(s) alike; "
                              "PEFT would silently make a smaller adapter there): lower r, or set a smaller r for "
                              "them with rank_pattern.")


def _peft_draws(targets, init) -> list:
    """PEFT's generator use before and inside each decomposition, in its order: the two constructor draws of each
    target, then (``pissa_niter_<n>``) ``svd_lowrank``'s ``min(out, in) x r`` Gaussian, whose starting state is
    returned (None per target otherwise) for the rank decomposing that target to replay."""
    niter, states = _niter(init), []
    for t in targets:
        _constructed(t)
        states.append(None)
        if niter is not None:
            states[-1] = torch.get_rng_state()
            torch.randn(min(t.in_features, t.out_features), t.r)  # NOTE: torch._lowrank.get_approximate_basis's R
    return states


def _decompose(weight: torch.Tensor, t, init, state) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of target ``t`` from its HF weight, as PEFT's ``pissa_init`` / ``olora_init`` (float32)."""
    weight = weight.to(torch.float32).contiguous()  # NOTE: a fused weight's rows: a contiguous matrix as PEFT's
    r = t.r
    if init.lower() == "olora":
        q, rr = torch.linalg.qr(weight)
        return rr[:r].contiguous(), q[:, :r].contiguous()
    niter = _niter(init)
    if niter is None:
        v, s, uh = torch.linalg.svd(weight, full_matrices=False)
        vr, sr, uhr = v[:, :r], s[:r], uh[:r]
    else:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            vr, sr, ur = torch.svd_lowrank(weight.cpu(), r, niter=niter)
        uhr = ur.t()
    sr = sr / t.scaling
    return torch.diag(torch.sqrt(sr)) @ uhr, vr @ torch.diag(torch.sqrt(sr))


def decomposed_initial_weights(model, targets, init) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) in float32 at HF shapes for each target, decomposed from ``model``'s base weights as PEFT's
    ``pissa_init`` / ``olora_init`` (zeros for targets of other pipeline stages); the CPU generator advanced as
    PEFT's. Collective over every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.builder import layer_owners
    from loongforge_hf.bridges.distribution import agree_on_error
    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora.vision import chunk_params, text_bridge

    check_decomposition(init, targets)
    states = _peft_draws(targets, init)
    owners = layer_owners(model.megatron.config, model.parallel)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp_group, tp_size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    stage = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    stage_ranks = dist.get_process_group_ranks(stage) if dist.is_initialized() else [0]
    me = stage_ranks.index(dist.get_rank()) if dist.is_initialized() else 0
    ctx = shard_context(text_bridge(model), tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp_size,
                        padded_vocab=model.megatron.padded_vocab)
    params = [chunk_params(chunk) for chunk in model.chunks]
    device = model.device
    out = [(torch.zeros(t.a_shape, device=device), torch.zeros(t.b_shape, device=device)) for t in targets]
    here = [i for i, t in enumerate(targets) if owners[t.layer][0] == pp_rank]
    decomposer = {i: n % len(stage_ranks) for n, i in enumerate(here)}  # NOTE: round-robin over the stage's ranks
    by_weight: dict[tuple[int, str], list[int]] = {}
    for i in here:
        _, vp, local = owners[targets[i].layer]
        by_weight.setdefault((vp or 0, targets[i].mapping.megatron.format(layer=local)), []).append(i)
    error = None
    for (vp, name), indices in by_weight.items():
        mapping, layer = targets[indices[0]].mapping, targets[indices[0]].layer
        local = params[vp][name].detach()
        shards = [local]
        if mapping.tp_split is not None and tp_size > 1:  # NOTE: collective over TP: every rank joins
            shards = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(tp_size)]
            dist.all_gather(shards, local.contiguous(), group=tp_group)
        mine = [i for i in indices if decomposer[i] == me]
        if not mine or error is not None:
            continue
        try:
            hf = mapping.export(shards, ctx, layer)
            for i in mine:
                t = targets[i]
                weight = hf[mapping.hf_names(layer)[t.slot]]
                a, b = _decompose(weight.t() if t.stored_transposed else weight, t, init, states[i])
                out[i] = (a.to(device).contiguous(), b.to(device).contiguous())
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            error = f"{type(e).__name__}: {e}"
        del shards
    error = agree_on_error(error)
    if error is not None:
        raise RuntimeError(f"init_lora_weights={init!r}: decomposing the base weights failed: {error}")
    if len(stage_ranks) > 1:
        for i in here:
            for factor in out[i]:
                dist.broadcast(factor, src=stage_ranks[decomposer[i]], group=stage)
    return out
