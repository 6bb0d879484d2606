"""Rank functions for the LoRA tests (module-level so spawned ranks can import them).

``layer_checks``: megatron's Column/RowParallelLinear with adapters against plain torch on full HF-shaped tensors,
outputs and gradients (input, A, B), TP=2 with and without sequence parallelism.
``model_checks``: a tiny Llama with LoRA against ``peft.get_peft_model`` on the transformers model: logits, loss,
adapter gradients (summed over context-parallel ranks, as megatron's DDP sums them), parameter counts, what megatron's
optimizer holds, the PEFT adapter folder and the merged export.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge_hf.bridges import transforms as T

ATOL = RTOL = 1e-5
LORA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
               modules_to_save=["post_attention_layernorm", "lm_head"])
# per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern): q_proj at r 8 everywhere, one layer's down_proj
# at r 2, v_proj's alpha 32, one layer's o_proj's alpha 3
PATTERN_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                  rank_pattern={"q_proj": 8, "model.layers.1.mlp.down_proj": 2},
                  alpha_pattern={"v_proj": 32, r"layers\.3\.self_attn\.o_proj": 3})


def _close(actual, expected, what, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _linear_config(sequence_parallel: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                             params_dtype=torch.float32, tensor_model_parallel_size=2,
                             sequence_parallel=sequence_parallel, perform_initialization=False)


def _adapter(a, b, *, scaling, split):
    from loongforge_hf.lora.layers import LoraAdapter

    return LoraAdapter(a.clone(), b.clone(), scaling=scaling, dropout=0.0, split=split)


def _column_qkv_check(sp: bool) -> None:
    """linear_qkv (4 heads, 2 KV groups, head_dim 3) with adapters on q_proj and v_proj only."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from loongforge_hf.lora.layers import FusedLayout, attach_adapters

    rank, tp = dist.get_rank(), 2
    heads, groups, hd, hidden, r, s, b = 4, 2, 3, 16, 2, 6, 2
    g = torch.Generator().manual_seed(1)
    wq, wk, wv = (torch.randn(n * hd, hidden, generator=g) for n in (heads, groups, groups))
    aq, bq = torch.randn(r, hidden, generator=g), torch.randn(heads * hd, r, generator=g)
    av, bv = torch.randn(r, hidden, generator=g), torch.randn(groups * hd, r, generator=g)
    x = torch.randn(s, b, hidden, generator=g)
    proj = torch.randn(s, b, (heads + 2 * groups) * hd, generator=g)
    scaling = 0.7

    # reference: HF-shaped projections, then this rank's heads fused as megatron lays them out
    ref_params = [t.clone().requires_grad_() for t in (x, aq, bq, av, bv)]
    rx, raq, rbq, rav, rbv = ref_params
    q = F.linear(rx, wq) + F.linear(F.linear(rx, raq), rbq) * scaling
    k = F.linear(rx, wk)
    v = F.linear(rx, wv) + F.linear(F.linear(rx, rav), rbv) * scaling
    hl, gl = heads // tp, groups // tp

    def local(t, n, i):
        return t[..., i * n * hd:(i + 1) * n * hd]

    fused = [T.fuse_qkv(local(q, hl, i).movedim(-1, 0), local(k, gl, i).movedim(-1, 0), local(v, gl, i).movedim(-1, 0),
                        num_heads=hl, num_kv_heads=gl, head_dim=hd).movedim(0, -1) for i in range(tp)]
    loss = sum((f * p).sum() for f, p in zip(fused, proj.chunk(tp, dim=-1)))
    loss.backward()

    module = ColumnParallelLinear(hidden, (heads + 2 * groups) * hd, config=_linear_config(sp), init_method=None,
                                  bias=False, gather_output=False, skip_bias_add=True)
    with torch.no_grad():
        module.weight.copy_(T.fuse_qkv(local(wq.t(), hl, rank).t(), local(wk.t(), gl, rank).t(),
                                       local(wv.t(), gl, rank).t(), num_heads=hl, num_kv_heads=gl, head_dim=hd))
    module.weight.requires_grad_(False)
    layout = FusedLayout(groups=gl, slots=(("q_proj", heads // groups * hd), ("k_proj", hd), ("v_proj", hd)))
    attach_adapters(module, {"q_proj": _adapter(aq, local(bq.t(), hl, rank).t(), scaling=scaling, split="B"),
                             "v_proj": _adapter(av, local(bv.t(), gl, rank).t(), scaling=scaling, split="B")}, layout)
    what = f"column qkv sp={sp}"
    check_column_forward_backward(module, x, proj, sp, fused[rank], rx.grad, what)
    _close(module.lora["q_proj"].A.grad, raq.grad, f"{what} A(q) grad")
    _close(module.lora["v_proj"].A.grad, rav.grad, f"{what} A(v) grad")
    _close(module.lora["q_proj"].B.grad, local(rbq.grad.t(), hl, rank).t(), f"{what} B(q) grad")
    _close(module.lora["v_proj"].B.grad, local(rbv.grad.t(), gl, rank).t(), f"{what} B(v) grad")


def frozen_row_parallel(w: torch.Tensor, sp: bool):
    """megatron's RowParallelLinear (TP=2, no bias) holding this rank's input columns of ``w`` [out, in], frozen."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    module = RowParallelLinear(w.shape[1], w.shape[0], config=_linear_config(sp), init_method=None, bias=False,
                               input_is_parallel=True, skip_bias_add=True)
    with torch.no_grad():
        module.weight.copy_(w.chunk(2, dim=1)[dist.get_rank()])
    module.weight.requires_grad_(False)
    return module


def check_column_forward_backward(module, x, proj, sp: bool, expected, expected_x_grad, what: str) -> None:
    """Run column-parallel ``module`` (TP=2) on ``x`` (its sequence shard under SP), backpropagate ``proj``'s rows
    of this rank; its output against ``expected`` (this rank's), the input gradient against ``expected_x_grad``."""
    rank, tp = dist.get_rank(), 2
    xin = (x.chunk(tp, dim=0)[rank] if sp else x).clone().requires_grad_()
    out, _ = module(xin)
    (out * proj.chunk(tp, dim=-1)[rank]).sum().backward()
    _close(out, expected, f"{what} output")
    _close(xin.grad, expected_x_grad.chunk(tp, dim=0)[rank] if sp else expected_x_grad, f"{what} input grad")


def _row_check(sp: bool) -> None:
    from loongforge_hf.lora.layers import attach_adapters

    rank, tp = dist.get_rank(), 2
    inp, hidden, r, s, b = 12, 16, 3, 6, 2
    g = torch.Generator().manual_seed(2)
    w, a, bb = (torch.randn(*shape, generator=g) for shape in ((hidden, inp), (r, inp), (hidden, r)))
    x, proj = torch.randn(s, b, inp, generator=g), torch.randn(s, b, hidden, generator=g)
    scaling = 1.3
    rx, ra, rb = (t.clone().requires_grad_() for t in (x, a, bb))
    ref = F.linear(rx, w) + F.linear(F.linear(rx, ra), rb) * scaling
    (ref * proj).sum().backward()

    module = frozen_row_parallel(w, sp)
    attach_adapters(module, {"o_proj": _adapter(a.chunk(tp, dim=1)[rank], bb, scaling=scaling, split="A")}, None)
    xin = x.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    out, _ = module(xin)
    local_proj = proj.chunk(tp, dim=0)[rank] if sp else proj
    (out * local_proj).sum().backward()
    what = f"row sp={sp}"
    _close(out, ref.chunk(tp, dim=0)[rank] if sp else ref, f"{what} output")
    _close(xin.grad, rx.grad.chunk(tp, dim=-1)[rank], f"{what} input grad")
    _close(module.lora["o_proj"].A.grad, ra.grad.chunk(tp, dim=1)[rank], f"{what} A grad")
    _close(module.lora["o_proj"].B.grad, rb.grad, f"{what} B grad")


def layer_checks() -> list[str]:
    from loongforge_hf.parallel import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_parallel_size=2))
    done = []
    for sp in (False, True):
        _column_qkv_check(sp)
        _row_check(sp)
        done += [f"column_qkv_sp{int(sp)}", f"row_sp{int(sp)}"]
    return done


# ---------------------------------------------------------------------------------------------------- whole model

def _gather_full(tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The full tensor from TP shards concatenated along ``dim`` (``None``: replicated)."""
    from megatron.core import parallel_state as ps

    if dim is None or ps.get_tensor_model_parallel_world_size() == 1:
        return tensor
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def lora_shard_context(model):
    """The ``ShardContext`` of this rank's TP shard of ``model`` (what ``Target.b_to_hf`` / ``b_to_megatron`` take)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora.vision import text_bridge

    return shard_context(text_bridge(model), tp_rank=ps.get_tensor_model_parallel_rank(),
                         tp_size=ps.get_tensor_model_parallel_world_size(), padded_vocab=model.megatron.padded_vocab)


def _check_adapter_grads(model, ref, our_loss, their_loss) -> None:
    """Adapter gradients at HF shapes against PEFT's: q_proj of layer 1 (column split) and down_proj of layer 2
    (row split)."""
    from megatron.core import parallel_state as ps

    our_loss.backward()
    their_loss.backward()
    if ps.get_context_parallel_world_size() > 1:   # each CP rank holds its sequence share's part, as DDP sums them
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
    ref_params = dict(ref.named_parameters())
    heads, hd = 4, 16
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    chunk = dict(model.chunks[0].named_parameters())
    rows = slice(tp_rank * heads // tp * hd, (tp_rank + 1) * heads // tp * hd)
    prefix = "base_model.model.model.layers"
    _close(chunk["decoder.layers.1.self_attention.linear_qkv.lora.q_proj.A"].grad,
           ref_params[f"{prefix}.1.self_attn.q_proj.lora_A.default.weight"].grad, "dA q_proj")
    _close(chunk["decoder.layers.1.self_attention.linear_qkv.lora.q_proj.B"].grad,
           ref_params[f"{prefix}.1.self_attn.q_proj.lora_B.default.weight"].grad[rows], "dB q_proj")
    _close(_gather_full(chunk["decoder.layers.2.mlp.linear_fc2.lora.down_proj.A"].grad, dim=1),
           ref_params[f"{prefix}.2.mlp.down_proj.lora_A.default.weight"].grad, "dA down_proj")
    _close(chunk["decoder.layers.2.mlp.linear_fc2.lora.down_proj.B"].grad,
           ref_params[f"{prefix}.2.mlp.down_proj.lora_B.default.weight"].grad, "dB down_proj")
    model.zero_grad(set_to_none=True)


def lora_pair(folder: str, layout: dict, lora_kw: dict, *, image_text: bool = False):
    """(our model with adapters, the transformers model, PEFT's model on it): the same LoraConfig after the same
    seed, so both start from PEFT's values (``image_text``: the Auto*ForImageTextToText classes)."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    from loongforge_hf.testing.tiny_models import hf_causal_lm

    auto = "AutoModelForImageTextToText" if image_text else "AutoModelForCausalLM"
    model = getattr(lf, auto).from_pretrained(folder, dtype=torch.float32, **layout)
    transformers.set_seed(5)
    model = get_peft_model(model, peft.LoraConfig(**lora_kw))
    # NOTE: a text model by its config's architecture where transformers' Auto class does not map it (Mistral 4)
    hf = getattr(transformers, auto).from_pretrained(folder, dtype=torch.float32) if image_text else \
        hf_causal_lm(folder, dtype=torch.float32)
    transformers.set_seed(5)
    return model, hf, peft.get_peft_model(hf, peft.LoraConfig(**lora_kw))


def model_checks(folder: str, out_dir: str, layout: dict, lora_kw: dict = LORA_KW) -> dict:
    import transformers
    from megatron.core import parallel_state as ps

    from loongforge_hf.trainer.engine import MegatronEngine

    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model, hf, ref = lora_pair(folder, layout, lora_kw)
    result = {"counts": model.get_nb_trainable_parameters(), "peft_counts": ref.get_nb_trainable_parameters()}

    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    _close(ours.logits, theirs.logits, "logits", atol=1e-4, rtol=1e-4)
    _close(ours.loss, theirs.loss, "loss")
    if model.parallel.pipeline_parallel_size == 1:
        _check_adapter_grads(model, ref, ours.loss, theirs.loss)

    # megatron's DDP and optimizer hold exactly the trainable parameters
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = MegatronEngine(model, args=transformers.TrainingArguments(out_dir + "/unused", use_cpu=True,
                                                                       report_to=[]))
    optimized = [p for opt in engine.inner_optimizers() for group in opt.param_groups for p in group["params"]]
    # the distributed optimizer's shards over the data-parallel (with context-parallel) ranks cover exactly the
    # trainable parameters
    numel = torch.tensor([sum(p.numel() for p in optimized)])
    dist.all_reduce(numel, group=ps.get_data_parallel_group(with_context_parallel=True))
    result["ddp_holds_trainable_only"] = {id(p) for c in engine.chunks for p in c.params_with_grad} == \
        {id(p) for p in trainable}
    result["optimizer_numel"] = (int(numel), sum(p.numel() for p in trainable))
    result["frozen_tensors"] = sum(1 for p in model.parameters() if not p.requires_grad)

    result.update(export_checks(model, folder, out_dir, ids, ours.logits))
    return result


def export_checks(model, folder: str, out_dir: str, ids: torch.Tensor, logits: torch.Tensor) -> dict:
    """The adapter folder and the merged export of ``model`` (whose logits on ``ids`` are ``logits``): the model
    unchanged by the merged export; on rank 0, PEFT's logits with the adapter folder and transformers' with the
    merged folder, as differences from ``logits``."""
    import peft

    from loongforge_hf.testing.tiny_models import hf_causal_lm

    model.save_pretrained(out_dir + "/adapter")
    model.save_pretrained(out_dir + "/merged", merged=True)
    result = {"unchanged_after_merged_export": torch.equal(model(input_ids=ids).logits, logits.detach())}
    if dist.get_rank() == 0:
        with torch.no_grad():
            loaded = peft.PeftModel.from_pretrained(hf_causal_lm(folder, dtype=torch.float32), out_dir + "/adapter")
            result["adapter_logits_diff"] = float((loaded(input_ids=ids).logits - logits).abs().max())
            merged = hf_causal_lm(out_dir + "/merged", dtype=torch.float32)
            result["merged_logits_diff"] = float((merged(input_ids=ids).logits - logits).abs().max())
    return result


# EXAONE 3: PEFT's Llama names (transformers' module tree) on a checkpoint named transformer.h.N.attn.attention.*
EXAONE_KW = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                 init_lora_weights=False)


def renamed_checkpoint_checks(folder: str, out_dir: str, layout: dict) -> dict:
    """LoRA on EXAONE 3 (``folder``: Llama's layer under GPT-2-style checkpoint names) against PEFT on the model
    transformers builds for it: logits and loss (1e-5), every adapter gradient of layer 1 at HF shape (q / v in the
    fused qkv, o_proj, gate / up in the fused fc1, down_proj), the adapter folder and the merged export."""
    from megatron.core import parallel_state as ps

    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model, hf, ref = lora_pair(folder, layout, EXAONE_KW)
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    _close(ours.logits, theirs.logits, "EXAONE logits")
    _close(ours.loss, theirs.loss, "EXAONE loss")
    ours.loss.backward()
    theirs.loss.backward()
    chunk, ref_params = dict(model.chunks[0].named_parameters()), dict(ref.named_parameters())
    compared = []
    for t in (t for t in model.lora_plan.targets if t.layer == 1):
        base = f"{t.megatron_module.format(layer=1)}.lora.{t.name}"
        split = 1 if t.kind == "row" else 0   # NOTE: A's input columns of a row-split linear, else B's rows
        for factor in ("A", "B"):
            grad = chunk[f"{base}.{factor}"].grad
            if (factor == "A") == (split == 1) and ps.get_tensor_model_parallel_world_size() > 1:
                grad = _gather_full(grad, split)
            _close(grad, ref_params[f"base_model.model.{t.hf_module}.lora_{factor}.default.weight"].grad,
                   f"EXAONE d{factor} {t.hf_module}")
        compared.append(f"{t.hf_module}:{t.name}")
    model.zero_grad(set_to_none=True)
    return {"compared": compared, **export_checks(model, folder, out_dir, ids, ours.logits)}


def tp2_and_pp2_checks(folder: str, out_dir: str, exaone_folder: str) -> dict:
    """One 2-rank world: the layer checks, the model checks under TP=2, PP=2 and CP=2, unseeded initial adapters and
    dropout under TP=2 (+SP), EXAONE 3's renamed checkpoint under TP=2 + SP."""
    return {"layers": layer_checks(),
            "exaone_tp2_sp": renamed_checkpoint_checks(exaone_folder, out_dir + "/exaone",
                                                       {"tensor_parallel_size": 2, "sequence_parallel": True}),
            "tp2": model_checks(folder, out_dir + "/tp2", {"tensor_parallel_size": 2}),
            "pp2": model_checks(folder, out_dir + "/pp2", {"pipeline_parallel_size": 2}),
            "cp2": model_checks(folder, out_dir + "/cp2", {"context_parallel_size": 2}),
            "tp2_sp_patterns": model_checks(folder, out_dir + "/tp2-sp-patterns",
                                            {"tensor_parallel_size": 2, "sequence_parallel": True}, PATTERN_KW),
            "pp2_patterns": model_checks(folder, out_dir + "/pp2-patterns", {"pipeline_parallel_size": 2},
                                         PATTERN_KW),
            "unseeded": unseeded_adapters_are_rank0s(folder, out_dir + "/unseeded"),
            "dropout": dropout_keeps_replicas_in_step(folder, {"tensor_parallel_size": 2}),
            "dora_dropout_sp": dropout_keeps_replicas_in_step(
                folder, {"tensor_parallel_size": 2, "sequence_parallel": True}, dora=True),
            "dropout_sp": dropout_keeps_replicas_in_step(folder, {"tensor_parallel_size": 2,
                                                                  "sequence_parallel": True})}


def unseeded_adapters_are_rank0s(folder: str, out_dir: str) -> dict:
    """``get_peft_model`` at TP2 where the script never seeded and the ranks' generators differ (set apart here):
    how many replicated factors differ between the two ranks (their names), and, on rank 0, the adapter folder
    against PEFT's draw from rank 0's generator state (``init_lora_weights=False``: A and B both drawn)."""
    import peft
    import transformers
    from safetensors.torch import load_file

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    kw = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2)
    torch.manual_seed(100 + dist.get_rank())
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    model = get_peft_model(model, peft.LoraConfig(**kw))
    out = {"replicated": [], "differ": []}
    for name, p in model.named_parameters():
        if p.requires_grad and not getattr(p, "tensor_model_parallel", True):
            both = [torch.empty_like(p) for _ in range(dist.get_world_size())]
            dist.all_gather(both, p.detach().contiguous())
            out["replicated"].append(name)
            if not torch.equal(both[0], both[1]):
                out["differ"].append(name)
    model.save_pretrained(out_dir)
    if dist.get_rank() == 0:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        torch.set_rng_state(state[0])
        theirs = peft.get_peft_model_state_dict(peft.get_peft_model(hf, peft.LoraConfig(**kw)))
        ours = load_file(f"{out_dir}/adapter_model.safetensors")
        out["keys"] = sorted(ours) == sorted(theirs) and len(ours) > 0
        out["max_diff"] = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    return out


def dropout_keeps_replicas_in_step(folder: str, layout: dict, dora: bool = False) -> list[str]:
    """lora_dropout > 0 under TP: a replicated factor (A of a column-parallel target, B of a row-parallel one, DoRA's
    magnitude of a row-parallel one) must get the same gradient on every TP rank, or the replicas drift apart: as
    megatron steps it, summed over the TP ranks first where it is marked ``sequence_parallel`` (a factor applied to
    each rank's token shard, as the router's and Qwen2-MoE's shared-expert gate's under SP). Returns the factors
    compared."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    transformers.set_seed(5)
    model = get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules="all-linear",
                                                  init_lora_weights=False, use_dora=dora))
    model.train()
    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    compared = []
    for name, p in model.named_parameters():
        if p.grad is None or getattr(p, "tensor_model_parallel", True):
            continue
        grad = p.grad.clone()
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(grad)  # NOTE: the world is the TP group here
        grads = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(grads, grad.contiguous())
        _close(grads[1], grads[0], f"{name} gradient on TP ranks (dropout)")
        compared.append(name)
    return compared


def adapter_round_trips(model, ref, folder: str, out_dir: str, layout: dict, ids: torch.Tensor,
                        peft_logits: torch.Tensor) -> dict:
    """What an adapter model (``model``, ours; ``ref``, PEFT's on transformers' model) gives after training-free round
    trips, as max |difference| of logits: the adapter folder in ``PeftModel.from_pretrained`` (``adapter_logits``,
    rank 0), the merged export in transformers against ours (``merged_vs_ours``) and against PEFT's
    ``merge_and_unload`` (``merged_vs_peft_merged``), our folder's and PEFT's tensor names and shapes (``folder``),
    ``disable_adapter()`` and ``unload()`` against PEFT's base logits, PEFT's folder through our ``load_adapter``
    against ``peft_logits``; ``unchanged_after_merged_export``. Collective (every rank); ``model`` is unloaded."""
    import peft
    import torch.distributed as dist

    import loongforge_hf as lf
    from loongforge_hf.lora import load_adapter
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    from .test_lora_new_bridges import _folder_tensors

    out = {}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(f"{out_dir}/adapter")
    model.save_pretrained(f"{out_dir}/merged", merged=True)
    with torch.no_grad():
        out["unchanged_after_merged_export"] = torch.equal(model(input_ids=ids).logits, logits)
    if dist.get_rank() == 0:
        ref.save_pretrained(f"{out_dir}/peft")
        with torch.no_grad():
            loaded = peft.PeftModel.from_pretrained(hf_causal_lm(folder, dtype=torch.float32), f"{out_dir}/adapter")
            out["adapter_logits"] = float((loaded(input_ids=ids).logits - logits).abs().max())
            merged = hf_causal_lm(f"{out_dir}/merged", dtype=torch.float32)(input_ids=ids).logits
            out["merged_vs_ours"] = float((merged - logits).abs().max())
            out["merged_vs_peft_merged"] = float((merged - loaded.merge_and_unload()(input_ids=ids).logits).abs().max())
        out["folder"] = [_folder_tensors(f"{out_dir}/adapter"), _folder_tensors(f"{out_dir}/peft")]
    dist.barrier()
    with torch.no_grad(), ref.disable_adapter():
        base = ref(input_ids=ids).logits
    with torch.no_grad(), model.disable_adapter():
        out["disabled"] = float((model(input_ids=ids).logits - base).abs().max())
    model.unload()
    with torch.no_grad():
        out["unloaded"] = float((model(input_ids=ids).logits - base).abs().max())
    fresh = load_adapter(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
                         f"{out_dir}/peft")
    with torch.no_grad():
        out["load_adapter_logits"] = float((fresh(input_ids=ids).logits - peft_logits.detach()).abs().max())
    return out
