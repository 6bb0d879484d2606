"""Rank function for test_kv_replicas.py: tiny models with fewer KV heads than TP ranks (each head replicated), against
transformers (fp32): logits, gradients after a backward, two optimizer steps of the engine with clipping active
against a hand-written transformers step, and LoRA on ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` against
PEFT. Our model runs where LOONGFORGE_DEVICE puts it (CPU processes over gloo, or two GPUs over NCCL:
test_kv_replicas_gpu.py); transformers' on the CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

LAYOUT = {"tensor_parallel_size": 2, "sequence_parallel": True}
LR, EPS, WD, MAX_GRAD_NORM, STEPS = 1e-2, 1e-6, 0.1, 0.05, 2  # NOTE: MAX_GRAD_NORM small: every step clips


def _ids(seed: int, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def _micro_batches() -> list[dict]:
    out = []
    for i in range(2):
        ids = _ids(10 + i)
        labels = ids.clone()
        labels[:, :2 + 3 * i] = -100  # NOTE: unequal label counts per micro-batch
        out.append({"input_ids": ids, "labels": labels})
    return out


def _hf_steps(hf) -> list[float]:
    """transformers' model stepped as the engine steps: the mean loss over the step's label tokens, the global norm
    clipped to MAX_GRAD_NORM, AdamW without decay on biases and 1-D tensors; the norms before clipping."""
    decay = [p for n, p in hf.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    rest = [p for n, p in hf.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR,
                            eps=EPS)
    norms = []
    for _ in range(STEPS):
        opt.zero_grad()
        batches = _micro_batches()
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for b in batches:
            logits = hf(input_ids=b["input_ids"]).logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"][:, 1:].reshape(-1),
                                   ignore_index=-100, reduction="sum")
            (loss / tokens).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_GRAD_NORM)))
        opt.step()
    return norms


def _max_diffs(folder: str, expected: dict, *, relative: bool) -> dict:
    """Per HF tensor, the largest difference between ``folder``'s tensor (read by transformers) and ``expected``'s
    (relative to the largest expected value with ``relative``)."""
    import transformers

    got = dict(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
    out = {}
    for n, want in expected.items():
        scale = float(want.abs().max()) or 1.0 if relative else 1.0
        out[n] = float((got[n].detach() - want).abs().max()) / scale
    return out


def _replicas_equal(model) -> bool:
    """Whether every replicated K / V row block is bit-equal across the ranks holding the same HF head."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    equal = True
    for p in model.parameters():
        info = getattr(p, "kv_replica", None)
        if info is None:
            continue
        rows = p.detach()[info.rows[0]:info.rows[1]].contiguous()
        gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, rows, group=group)
        for rank, other in enumerate(gathered):
            if rank // info.replicas == info.head:
                equal &= torch.equal(other, rows)
    return equal


def _export_grads(model, folder: str) -> None:
    """Write the model's gradients as an HF checkpoint (through the bridge's own export), weights kept."""
    params = list(model.parameters())
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.grad)
        model.save_pretrained(folder)
        for p, k in zip(params, kept):
            p.copy_(k)
            p.grad = None


def _case(name: str, folder: str, precision: str | None, root: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine
    from tests.bridges._gradients import _reduce_as_megatron

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **LAYOUT)
    rank0 = dist.get_rank() == 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = _ids(2)
    out, want = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    result = {"logits": float((out.logits.cpu() - want.logits).abs().max()),
              "loss": abs(out.loss.item() - want.loss.item()),
              "marked": sum(getattr(p, "kv_replica", None) is not None for p in model.parameters())}
    model.save_pretrained(f"{root}/{name}-saved")
    # gradients of a plain backward, reduced as the engine's finalize reduces them (the replicas' sum included)
    out.loss.backward()
    _reduce_as_megatron(model)
    _export_grads(model, f"{root}/{name}-grads")
    if rank0:
        want.loss.backward()
        result["grads"] = _max_diffs(f"{root}/{name}-grads", {n: p.grad for n, p in ref.named_parameters()},
                                     relative=True)
    if precision is None:
        return result
    # two optimizer steps of the engine, clipping on every step
    args = transformers.TrainingArguments(f"{root}/{name}-run", use_cpu=model.device.type == "cpu",
                                          learning_rate=LR, weight_decay=WD,
                                          adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM, report_to=[])
    engine = MegatronEngine(model, args=args, optimizer_precision=precision)
    result["norms"] = [float(engine.train_step(_micro_batches()).grad_norm) for _ in range(STEPS)]
    result["replicas_equal"] = _replicas_equal(model)
    model.save_pretrained(f"{root}/{name}-trained")
    if rank0:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        result["hf_norms"] = _hf_steps(hf)
        result["trained"] = _max_diffs(f"{root}/{name}-trained", dict(hf.named_parameters()), relative=False)
    return result


# NOTE: the LoRA cases: (checkpoint case, target modules, with DoRA too); Phi-3's and GPTBigCode's packed q / k / v
LORA_CASES = {"llama": ("llama", ["q_proj", "k_proj", "v_proj", "o_proj"], True),
              "phi3": ("phi3", ["qkv_proj", "o_proj"], True),
              "gpt_bigcode": ("gpt_bigcode", ["c_attn"], False)}


def _lora(folders: dict, root: str) -> dict:
    """Per ``LORA_CASES`` entry, LoRA (and DoRA) against PEFT's at TP2 + SP with one KV head (the K / V adapters, or
    a packed q / k / v linear's K / V rows, on its replicas): logits, every adapter gradient after the engine's
    reductions (over TP where a factor is marked sequence-parallel, then over the replicas of a head; DoRA's
    magnitudes too), the LoRA adapter folder in PEFT and read back at TP2 (its replicated rows marked again)."""
    out = {}
    for case, (model_case, targets, dora) in LORA_CASES.items():
        kw = dict(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        out[case] = {name: _lora_against_peft(folders[model_case], f"{root}/{case}-{name}", kw, extra)
                     for name, extra in (("lora", {}), ("dora", {"use_dora": True})) if name == "lora" or dora}
    return out


def _lora_against_peft(folder: str, out_dir: str, kw: dict, extra: dict) -> dict:
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model, load_adapter
    from loongforge_hf.parallel.kv_replicas import sum_replica_grads
    from tests.integrations._lora_grads import module_adapter_grads

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **LAYOUT)
    transformers.set_seed(5)
    model = get_peft_model(model, peft.LoraConfig(**kw, **extra))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(5)
    hf = peft.get_peft_model(hf, peft.LoraConfig(**kw, **extra))
    ids = _ids(3)
    ours, theirs = model(input_ids=ids, labels=ids), hf(input_ids=ids, labels=ids)
    out = {"logits": float((ours.logits.detach().cpu() - theirs.logits.detach()).abs().max())}
    ours.loss.backward()
    theirs.loss.backward()
    for p in model.parameters():  # NOTE: what megatron's finalize does for factors applied to token shards
        if p.grad is not None and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad)
    sum_replica_grads(model.chunks)
    out["grads"] = [(f"{m}.{f}", float((got.cpu() - want).abs().max() / want.abs().max()))
                    for m, f, got, want in module_adapter_grads(model, hf, model.lora_plan.targets,
                                                                magnitudes=bool(extra))]
    if extra:
        return out
    model.save_pretrained(f"{out_dir}/adapter")
    # NOTE: the folder read back at TP2 (from_pretrained of it; load_adapter trainable: its replicated rows marked)
    loaded = lf.AutoModelForCausalLM.from_pretrained(f"{out_dir}/adapter", dtype=torch.float32, **LAYOUT)
    with torch.no_grad():
        out["loaded"] = float((loaded(input_ids=ids).logits.cpu() - theirs.logits.detach()).abs().max())
    trainable = load_adapter(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **LAYOUT),
                             f"{out_dir}/adapter", is_trainable=True)
    out["marked"] = sorted(n.split("layers.")[-1] for n, p in trainable.named_parameters()
                           if getattr(p, "kv_replica", None) is not None and ".lora." in n)
    if dist.get_rank() == 0:
        loaded = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), f"{out_dir}/adapter")
        with torch.no_grad():
            out["folder"] = float((loaded(input_ids=ids).logits - theirs.logits.detach()).abs().max())
    return out


def kv_replica_checks(cases: list[tuple[str, str, str | None]], root: str) -> dict:
    """Per case (name, checkpoint folder, the engine's optimizer_precision or None for no training): the numbers
    the tests read (rank 0 holds the transformers comparisons)."""
    out = {name: _case(name, folder, precision, root) for name, folder, precision in cases}
    out["lora"] = _lora({name: folder for name, folder, _ in cases}, root)
    return out
