"""Rank functions for test_lora_dora.py: DoRA (``LoraConfig(use_dora=True)``) against PEFT and plain torch.

``layer_checks``: megatron's Column/RowParallelLinear with DoRA adapters against the formula on full HF-shaped
tensors (magnitudes away from the row norms, a bias on the column layer, with and without an active "dropout"),
outputs and gradients of the input, A, B and the magnitude, TP=2 with and without sequence parallelism.
``model_checks``: a PEFT-written DoRA adapter (every factor and magnitude moved off its initial value) loaded here and
in PEFT: logits, loss, every adapter tensor's gradient, PEFT's counts, the adapter saved again (the same tensors),
the merged export in transformers, merge_and_unload. ``init_checks``: get_peft_model's magnitudes are PEFT's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loongforge_hf.bridges import transforms as T

from ._lora_checks import (_close, _gather_full, _linear_config, check_column_forward_backward, frozen_row_parallel,
                           lora_pair, lora_shard_context)

DORA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, use_dora=True)


class _Doubling(nn.Module):
    """A deterministic stand-in for an active dropout (not nn.Identity, so DoRA takes its dropout path)."""

    def forward(self, x):
        return 2 * x


def _dora_ref(x, w, bias, a, b, m, scaling, dropout):
    """PEFT's DoRA output of one HF linear: ``W x + bias + (s - 1) W xd + s scaling B A xd``, the norm detached."""
    xd = 2 * x if dropout else x
    norm = torch.linalg.vector_norm(w + scaling * (b @ a), dim=1).detach()
    s = m / norm
    out = F.linear(x, w) + (s - 1) * F.linear(xd, w) + s * F.linear(F.linear(xd, a), b) * scaling
    return out if bias is None else out + bias


def _column_qkv_check(sp: bool, dropout: bool) -> None:
    """linear_qkv (4 heads, 2 KV groups, head_dim 3, with bias) with DoRA on q_proj and v_proj only."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from loongforge_hf.lora.layers import FusedLayout, LoraAdapter, attach_adapters

    rank, tp = dist.get_rank(), 2
    heads, groups, hd, hidden, r, s, b = 4, 2, 3, 16, 2, 6, 2
    g = torch.Generator().manual_seed(1)
    wq, wk, wv = (torch.randn(n * hd, hidden, generator=g) for n in (heads, groups, groups))
    bq, bk, bv = (torch.randn(n * hd, generator=g) for n in (heads, groups, groups))
    aq, bbq, mq = torch.randn(r, hidden, generator=g), torch.randn(heads * hd, r, generator=g), \
        torch.rand(heads * hd, generator=g) + 3
    av, bbv, mv = torch.randn(r, hidden, generator=g), torch.randn(groups * hd, r, generator=g), \
        torch.rand(groups * hd, generator=g) + 3
    x = torch.randn(s, b, hidden, generator=g)
    proj = torch.randn(s, b, (heads + 2 * groups) * hd, generator=g)
    scaling = 0.7

    ref = [t.clone().requires_grad_() for t in (x, aq, bbq, mq, av, bbv, mv)]
    rx, raq, rbq, rmq, rav, rbv, rmv = ref
    q = _dora_ref(rx, wq, bq, raq, rbq, rmq, scaling, dropout)
    k = F.linear(rx, wk) + bk
    v = _dora_ref(rx, wv, bv, rav, rbv, rmv, scaling, dropout)
    hl, gl = heads // tp, groups // tp

    def local(t, n, i):
        return t[..., i * n * hd:(i + 1) * n * hd]

    fused = [T.fuse_qkv(local(q, hl, i).movedim(-1, 0), local(k, gl, i).movedim(-1, 0), local(v, gl, i).movedim(-1, 0),
                        num_heads=hl, num_kv_heads=gl, head_dim=hd).movedim(0, -1) for i in range(tp)]
    sum((f * p).sum() for f, p in zip(fused, proj.chunk(tp, dim=-1))).backward()

    module = ColumnParallelLinear(hidden, (heads + 2 * groups) * hd, config=_linear_config(sp), init_method=None,
                                  bias=True, gather_output=False, skip_bias_add=False)
    with torch.no_grad():
        module.weight.copy_(T.fuse_qkv(local(wq.t(), hl, rank).t(), local(wk.t(), gl, rank).t(),
                                       local(wv.t(), gl, rank).t(), num_heads=hl, num_kv_heads=gl, head_dim=hd))
        module.bias.copy_(T.fuse_qkv(local(bq, hl, rank), local(bk, gl, rank), local(bv, gl, rank),
                                     num_heads=hl, num_kv_heads=gl, head_dim=hd))
    module.weight.requires_grad_(False)
    module.bias.requires_grad_(False)
    layout = FusedLayout(groups=gl, slots=(("q_proj", heads // groups * hd), ("k_proj", hd), ("v_proj", hd)))
    adapters = {}
    for name, a, bb, m, n in (("q_proj", aq, bbq, mq, hl), ("v_proj", av, bbv, mv, gl)):
        adapters[name] = LoraAdapter(a.clone(), local(bb.t(), n, rank).t().clone(), scaling=scaling, dropout=0.0,
                                     split="B")
        adapters[name].add_magnitude(local(m, n, rank).clone(), split=True)
        if dropout:
            adapters[name].dropout = _Doubling()
    attach_adapters(module, adapters, layout)
    what = f"DoRA column qkv sp={sp} dropout={dropout}"
    check_column_forward_backward(module, x, proj, sp, fused[rank], rx.grad, what)
    for name, ra, rb, rm, n in (("q_proj", raq, rbq, rmq, hl), ("v_proj", rav, rbv, rmv, gl)):
        adapter = module.lora[name]
        _close(adapter.A.grad, ra.grad, f"{what} A({name}) grad")
        _close(adapter.B.grad, local(rb.grad.t(), n, rank).t(), f"{what} B({name}) grad")
        _close(adapter.magnitude.grad, local(rm.grad, n, rank), f"{what} magnitude({name}) grad")


def _row_check(sp: bool, dropout: bool) -> None:
    from loongforge_hf.lora.layers import LoraAdapter, attach_adapters

    rank, tp = dist.get_rank(), 2
    inp, hidden, r, s, b = 12, 16, 3, 6, 2
    g = torch.Generator().manual_seed(2)
    w, a, bb = (torch.randn(*shape, generator=g) for shape in ((hidden, inp), (r, inp), (hidden, r)))
    m = torch.rand(hidden, generator=g) + 3
    x, proj = torch.randn(s, b, inp, generator=g), torch.randn(s, b, hidden, generator=g)
    scaling = 1.3
    rx, ra, rb, rm = (t.clone().requires_grad_() for t in (x, a, bb, m))
    ref = _dora_ref(rx, w, None, ra, rb, rm, scaling, dropout)
    (ref * proj).sum().backward()

    module = frozen_row_parallel(w, sp)
    adapter = LoraAdapter(a.chunk(tp, dim=1)[rank].clone(), bb.clone(), scaling=scaling, dropout=0.0, split="A")
    adapter.add_magnitude(m.clone(), split=False)
    if dropout:
        adapter.dropout = _Doubling()
    attach_adapters(module, {"o_proj": adapter}, None)
    xin = x.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    out, _ = module(xin)
    (out * (proj.chunk(tp, dim=0)[rank] if sp else proj)).sum().backward()
    what = f"DoRA row sp={sp} dropout={dropout}"
    _close(out, ref.chunk(tp, dim=0)[rank] if sp else ref, f"{what} output")
    _close(xin.grad, rx.grad.chunk(tp, dim=-1)[rank], f"{what} input grad")
    _close(adapter.A.grad, ra.grad.chunk(tp, dim=1)[rank], f"{what} A grad")
    _close(adapter.B.grad, rb.grad, f"{what} B grad")
    _close(adapter.magnitude.grad, rm.grad, f"{what} magnitude grad")


def layer_checks() -> list[str]:
    from loongforge_hf.parallel import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_parallel_size=2))
    done = []
    for sp in (False, True):
        for dropout in (False, True):
            _column_qkv_check(sp, dropout)
            _row_check(sp, dropout)
            done += [f"column_sp{int(sp)}_drop{int(dropout)}", f"row_sp{int(sp)}_drop{int(dropout)}"]
    return done


# ---------------------------------------------------------------------------------------------------- whole model

def _adapter_grads_match(model, ref) -> int:
    """Every adapter tensor's gradient (A, B, DoRA's magnitude) at HF shape against PEFT's; returns how many were
    compared."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() > 1:  # NOTE: each CP rank holds its sequence share's part, as DDP sums
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
    theirs, ctx = dict(ref.named_parameters()), lora_shard_context(model)
    compared = 0
    for t in model.lora_plan.targets:
        adapter = model.chunks[0].get_submodule(t.megatron_module.format(layer=t.layer)).lora[t.name]
        column = t.kind != "row"
        ours = {"lora_A.default.weight": _gather_full(adapter.A.grad, None if column else 1),
                "lora_B.default.weight": t.b_to_hf(_gather_full(adapter.B.grad, 0 if column else None), ctx)}
        if getattr(adapter, "magnitude", None) is not None:  # NOTE: DoRA
            ours["lora_magnitude_vector.default.weight"] = \
                t.b_to_hf(_gather_full(adapter.magnitude.grad, 0 if column else None)[:, None], ctx)[:, 0]
        for key, grad in ours.items():
            _close(grad, theirs[f"base_model.model.{t.hf_module}.{key}"].grad, f"{t.hf_module} {key} grad")
            compared += 1
    return compared


def model_checks(folder: str, adapter_dir: str, out_dir: str, layout: dict) -> dict:
    import peft
    import transformers
    from safetensors.torch import load_file

    import loongforge_hf as lf
    from loongforge_hf.lora import load_adapter

    from ._lora_checks import export_checks

    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model = load_adapter(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout), adapter_dir,
                         is_trainable=True)
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                                           dtype=torch.float32),
                                         adapter_dir, is_trainable=True)
    result = {"counts": model.get_nb_trainable_parameters(), "peft_counts": ref.get_nb_trainable_parameters(),
              "targets": len(model.lora_plan.targets)}
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    _close(ours.logits, theirs.logits, "logits", atol=1e-4, rtol=1e-4)
    _close(ours.loss, theirs.loss, "loss")
    with torch.no_grad(), ref.disable_adapter():
        result["adapter_vs_base_logits"] = float((theirs.logits - ref(input_ids=ids).logits).abs().max())
    if model.parallel.pipeline_parallel_size == 1:
        ours.loss.backward()
        theirs.loss.backward()
        result["grads_compared"] = _adapter_grads_match(model, ref)
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        # NOTE: greedy cached generate, every decode step through the DoRA layers: PEFT's tokens and scores
        kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
        mine, peft_s = model.generate(input_ids=ids[:, :6], **kw), ref.generate(input_ids=ids[:, :6], **kw)
    result["generate_same_tokens"] = torch.equal(mine.sequences, peft_s.sequences)
    result["generate_scores_diff"] = float((torch.stack(mine.scores) - torch.stack(peft_s.scores)).abs().max())
    result.update(export_checks(model, folder, out_dir, ids, logits))
    if dist.get_rank() == 0:
        before, after = load_file(adapter_dir + "/adapter_model.safetensors"), load_file(
            out_dir + "/adapter/adapter_model.safetensors")
        result["same_tensors"] = sorted(before) == sorted(after) and all(
            torch.equal(before[n], after[n]) for n in before)
    merged = model.merge_and_unload()
    with torch.no_grad():
        result["merge_and_unload_diff"] = float((merged(input_ids=ids).logits - logits).abs().max())
    return result


def init_checks(folder: str, out_dir: str, layout: dict) -> dict:
    """get_peft_model's DoRA magnitudes (saved in the adapter folder) against PEFT's initial ones."""
    from safetensors.torch import load_file

    model, _, ref = lora_pair(folder, layout, DORA_KW)
    model.save_pretrained(out_dir)
    result = {"counts": model.get_nb_trainable_parameters(), "peft_counts": ref.get_nb_trainable_parameters()}
    if dist.get_rank() == 0:
        saved, theirs = load_file(out_dir + "/adapter_model.safetensors"), dict(ref.named_parameters())
        magnitudes = [n for n in saved if n.endswith(".lora_magnitude_vector")]
        for name in magnitudes:
            _close(saved[name], theirs[name + ".default.weight"], name, atol=1e-6, rtol=1e-6)
        result["magnitudes"] = len(magnitudes)
    return result


def kept_norm_checks(folder: str) -> dict:
    """Without grad mode the layers keep their row norms: a second forward computes none, and after an in-place
    change of a factor, a base weight (under ``no_grad``, as an optimizer step or a load) the logits are those of a
    forward with grad mode on (which always recomputes), bit for bit."""
    import loongforge_hf as lf
    from loongforge_hf.lora import dora, get_peft_model

    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model = get_peft_model(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           __import__("peft").LoraConfig(**DORA_KW))
    calls = []
    real = dora._squares

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dora._squares = counted
    try:
        out = {}
        with torch.no_grad():
            before = model(input_ids=ids).logits
            first = len(calls)
            model(input_ids=ids)
            out["computed"] = (first, len(calls) - first)
        chunk = model.chunks[0]
        with torch.no_grad():
            chunk.get_submodule("decoder.layers.1.self_attention.linear_qkv").lora["q_proj"].A.mul_(1.5)
            chunk.get_submodule("decoder.layers.2.mlp.linear_fc2").lora["down_proj"].B.add_(0.1)
            chunk.get_submodule("decoder.layers.0.mlp.linear_fc1").weight.mul_(0.9)
            changed = model(input_ids=ids).logits
        fresh = model(input_ids=ids).logits.detach()
        out["after_change_equal"] = torch.equal(changed, fresh)
        out["change_moved_logits"] = float((changed - before).abs().max())
    finally:
        dora._squares = real
    return out


def write_adapters(base, arch: str, adapters: dict) -> tuple[str, dict]:
    """A tiny ``arch`` checkpoint under ``base`` and, per name, a PEFT-written adapter of ``adapters[name]``'s
    LoraConfig kwargs (``_lora_load.write_peft_adapter``): (checkpoint folder, {name: adapter folder})."""
    from loongforge_hf.testing import make_tiny_checkpoint

    from ._lora_load import write_peft_adapter

    folder = make_tiny_checkpoint(base / "src", arch)
    for name, kw in adapters.items():
        write_peft_adapter(str(folder), str(base / name), kw)
    return str(folder), {name: str(base / name) for name in adapters}


def adapters_checks(folder: str, adapters: dict, out_dir: str, layout: dict) -> dict:
    """``model_checks`` of each adapter, by name (one rank's)."""
    return {name: model_checks(folder, adapter, f"{out_dir}/{name}", layout) for name, adapter in adapters.items()}


def assert_adapters_match_peft(results: list[dict], *, targets: int, pipeline: bool) -> None:
    """Every rank's ``adapters_checks``: counts, adapter tensors saved again bit for bit, PEFT's and transformers'
    logits from the adapter / merged folders, cached generate and merge_and_unload (1e-4), and (not under a pipeline,
    where the loss is on the last stage only) every A / B gradient, DoRA's magnitudes too, of ``targets`` adapters."""
    for name, rank0 in results[0].items():
        assert rank0["counts"] == rank0["peft_counts"], name
        assert rank0["targets"] == targets, name
        assert rank0["adapter_vs_base_logits"] > 1e-2, name  # the adapter changes the logits
        assert rank0["same_tensors"], name
        assert rank0["adapter_logits_diff"] < 1e-4 and rank0["merged_logits_diff"] < 1e-4, (name, rank0)
        for r in results:
            res = r[name]
            assert res["generate_same_tokens"] and res["generate_scores_diff"] < 1e-4, (name, res)
            assert res["merge_and_unload_diff"] < 1e-4, (name, res)
            assert res["unchanged_after_merged_export"], name
            if not pipeline:
                assert res["grads_compared"] == targets * (3 if name == "dora" else 2), (name, res["grads_compared"])
