"""DeepSeek-V4 (``bridges/deepseek_v4.py``) against transformers' ``DeepseekV4ForCausalLM`` on a tiny fp32 checkpoint
with every attention kind (sliding, compressed sparse with its indexer keeping 3 of up to 8 entries, heavily
compressed), hash-routed and top-k routed layers, 3 hyper-connection streams and a SwiGLU limit that clips: logits and
loss within 1e-4, the top-k layers' ``router_logits`` and transformers' balancing loss within 1e-5, at TP1, TP2 + SP
(attention replicated), EP2, TP2 + SP x EP2 (experts whole per rank), PP2 and PP2 x VPP2 (the hyper-connections' streams
cross the stages) and CP2 (each rank's queries over the whole sequence's keys), at 32 tokens and at 16 (compressed
branches with fewer entries); at both PP layouts also LoongTrainer's first step over two micro-batches (loss within
1e-4, gradient norm within 1e-4 relative, every gradient through the stages within 1e-4 of its largest entry); at TP1
also a left-padded row, greedy ``generate(use_cache=False)`` (a KV cache and packed documents refused by name) and the
hub's names; every gradient at TP2 + SP and at CP2 within 1e-4 of its largest entry (the frozen indexer's tensors take
none, as in transformers); bit-exact export at the six parallel layouts (the int64 ``tid2eid`` tables included). Beam
(``bridges/beam.py``, built on AFMoE's bridge) in the same world: logits, loss and ``router_logits`` at TP1, TP2 + SP x
EP2, PP2 and CP2, cached greedy generate with a left-padded row, every gradient (1e-4 of its largest entry) and a
bit-exact export at TP2 + SP x EP2, every gradient at CP2 and through LoongTrainer's step at PP2. LoRA against PEFT
(``"all-linear"`` but the grouped ``o_a_proj`` and the indexer, the routed experts' stacks and the routers as
``target_parameters``, ``init_lora_weights=False``) at TP1 and TP2 + SP x EP2: logits and loss within 1e-4, every
adapter's gradient within 1e-4 of its largest entry, the adapter folder in PEFT and the merged export in transformers
(logits within 1e-4); at TP2 + SP x EP2 the folder loaded onto a fresh model (``load_adapter``) and ``unload()``; at TP1
LoRA on the indexer alone (logits as PEFT's, no gradient on either side); LoRA training with LoongSFTTrainer at TP2 + SP
x EP2 (``lora_training``: resumed from its checkpoint exactly, at TP1 within 1e-5 relative, the checkpoint's adapter
folder in PEFT). One two-rank world runs it all; the layouts refused by name are tried first, before any process group
starts; the config, layout and LoRA refusals are pure."""

from __future__ import annotations

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

LAYOUTS = {"tp1": {}, "tp2sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
           "ep2": {"expert_parallel_size": 2},
           "tp2sp_ep2": {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
                         "expert_tensor_parallel_size": 1},
           "pp2": {"pipeline_parallel_size": 2},
           "pp2_vpp2": {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2},
           "cp2": {"context_parallel_size": 2}}
REFUSED = {"tp2": ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 with a mixture-of-experts model needs "
                                                "sequence_parallel=True")}


def _refusal(folder: str, layout: dict) -> dict:
    import torch.distributed as dist

    import loongforge_hf as lf

    try:
        lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    except Exception as err:  # noqa: BLE001 - the test checks type and message
        return {"type": type(err).__name__, "message": str(err), "collective_started": dist.is_initialized()}
    return {"type": "no error", "message": "", "collective_started": dist.is_initialized()}


def _gradients(model, folder: str, ids: torch.Tensor, tag: str = "") -> dict:
    """Our gradient of every HF tensor (through our export, to ``{folder}-grads{tag}``) against transformers',
    relative to its largest entry."""
    import torch.distributed as dist

    from loongforge_hf.testing.tiny_models import hf_causal_lm
    from tests.bridges._gradients import save_gradients

    model(input_ids=ids, labels=ids).loss.backward()
    save_gradients(model, f"{folder}-grads{tag}")
    if dist.get_rank() != 0:
        return {}
    ours = dict(hf_causal_lm(f"{folder}-grads{tag}", dtype=torch.float32).named_parameters())
    hf = hf_causal_lm(folder, dtype=torch.float32)
    hf(input_ids=ids, labels=ids).loss.backward()
    diffs = {}
    for n, p in hf.named_parameters():
        if p.grad is None:  # NOTE: transformers' indexer only chooses: no gradient, ours written unchanged
            diffs[n] = 0.0 if torch.equal(ours[n].detach(), p.detach()) else float("inf")
        else:
            diffs[n] = float((ours[n].detach() - p.grad).abs().max()) / (float(p.grad.abs().max()) or 1.0)
    return diffs


def _pipeline_step(model, folder: str, ids: torch.Tensor) -> dict:
    """LoongTrainer's first step (learning rate 0, two micro-batches) under the model's pipeline layout: its loss and
    gradient norm against transformers', and every gradient (the engine's, taken before the optimizer step and
    exported through the bridge) relative to its largest entry, as ``_gradients``. The model's weights are the
    gradients after."""
    import datasets
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    grads_dir = f"{folder}-pipeline-grads-{len(model.chunks)}"

    class SaveGradients(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            with torch.no_grad():  # NOTE: the engine's buffers hold the loss sum's gradient
                for p in model.parameters():
                    if getattr(p, "main_grad", None) is not None:
                        p.copy_(p.main_grad / ids[:, 1:].numel())
            model.save_pretrained(grads_dir)

    try:  # NOTE: refused under PP (the bridges' recompute_refusal), before any weight changes
        model.gradient_checkpointing_enable()
        recompute_refusal = ""
    except ValueError as err:
        recompute_refusal = str(err)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    # NOTE: two micro-batches of one row (the interleaved schedule needs as many as pipeline stages)
    args = transformers.TrainingArguments(output_dir=f"{folder}-pipeline-step", per_device_train_batch_size=1,
                                          gradient_accumulation_steps=2, max_steps=1, learning_rate=0.0,
                                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                          disable_tqdm=True, max_grad_norm=1.0)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=data, callbacks=[SaveGradients()])
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    if dist.get_rank() != 0:
        return {"recompute_refusal": recompute_refusal}
    ref = hf_causal_lm(folder, dtype=torch.float32)
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]).norm()
    ours = dict(hf_causal_lm(grads_dir, dtype=torch.float32).named_parameters())
    diffs = {}
    for n, p in ref.named_parameters():
        if p.grad is None:  # NOTE: the frozen indexer's: ours written unchanged
            diffs[n] = 0.0 if torch.equal(ours[n].detach(), p.detach()) else float("inf")
        else:
            diffs[n] = float((ours[n].detach() - p.grad).abs().max()) / (float(p.grad.abs().max()) or 1.0)
    return {"loss": abs(log["loss"] - loss.item()), "grad_norm": abs(log["grad_norm"] - norm.item()) / norm.item(),
            "grads": diffs, "recompute_refusal": recompute_refusal}


def _exported_equal(folder: str, out: str, extra: tuple[str, ...] = ()) -> dict:
    from safetensors import safe_open

    def tensors(path):
        import glob

        found = {}
        for f in glob.glob(f"{path}/*.safetensors"):
            with safe_open(f, "pt") as s:
                found.update({k: s.get_tensor(k) for k in s.keys()})
        return found

    a, b = tensors(folder), tensors(out)
    return {"same_names": sorted([*a, *extra]) == sorted(b),
            "unequal": sorted(k for k in a if k in b and (a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])))}


def _padded_and_generate(model, ref, ids: torch.Tensor) -> dict:
    """Left padding (the real tokens' logits) and greedy ``generate(use_cache=False)``; a KV cache and packed
    documents refused."""
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        theirs = ref(input_ids=ids, attention_mask=mask).logits
    prompt = ids[:, :14]
    tokens = model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=False)
    expected = ref.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=False)
    try:
        model.generate(prompt, max_new_tokens=2, do_sample=False)
        refusal = ""
    except Exception as err:  # noqa: BLE001 - the test reads the message
        refusal = str(err)
    packed = torch.cat([torch.arange(20), torch.arange(12)]).expand(2, -1)
    try:
        model(input_ids=ids, position_ids=packed)
        packed_refusal = ""
    except Exception as err:  # noqa: BLE001 - the test reads the message
        packed_refusal = str(err)
    return {"padded": (ours - theirs)[mask.bool()].abs().max().item(), "generate": torch.equal(tokens, expected),
            "cache_refusal": refusal, "packed_refusal": packed_refusal}


def _packed_training(model, out_dir: str, ids: torch.Tensor) -> str:
    """LoongTrainer on packed rows (two documents a row): the error's type and message (refused on every rank by the
    batch check, before the step's collectives)."""
    import datasets
    import transformers

    import loongforge_hf as lf
    from tests.trainer._train_parity import training_args

    packed = torch.cat([torch.arange(20), torch.arange(12)]).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist(), "position_ids": [packed] * 2})
    args = training_args(out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=1)
    try:
        lf.LoongTrainer(model=model, args=args, train_dataset=data,
                        data_collator=transformers.default_data_collator).train()
    except Exception as err:  # noqa: BLE001 - the test reads the type and message
        return f"{type(err).__name__}: {err}"
    return ""


def _hub_named(folder: str) -> str:
    """The checkpoint under the hub's names (no ``model.``; ``embed``, ``hc_head_*``), one file with an ``mtp.*``
    tensor."""
    import glob
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    hub = f"{folder}-hub"
    shutil.copytree(folder.rsplit("-rank", 1)[0], hub)
    tensors = {"mtp.0.norm.weight": torch.ones(64)}
    for f in glob.glob(f"{hub}/model*.safetensors*"):
        if f.endswith(".safetensors"):
            for k, v in load_file(f).items():
                k = re.sub(r"^model\.hc_head\.hc_", "hc_head_", re.sub(r"^model\.embed_tokens\.", "embed.", k))
                tensors[k.removeprefix("model.")] = v
        os.remove(f)
    save_file(tensors, f"{hub}/model.safetensors", metadata={"format": "pt"})
    return hub


def _hub_checks(folder: str, ref, ids: torch.Tensor) -> dict:
    """The hub's names load (logits as transformers') and export under transformers' names, ``mtp.*`` kept."""
    import torch.distributed as dist

    import loongforge_hf as lf

    hub = _hub_named(f"{folder}-rank{dist.get_rank()}")
    model = lf.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    model.save_pretrained(f"{hub}-out")
    return {"hub_logits": diff, "hub_export": _exported_equal(folder, f"{hub}-out", extra=("mtp.0.norm.weight",))}


def _world(folder: str) -> dict:
    import torch.distributed as dist

    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    out = {name: _refusal(folder, layout) for name, (layout, _) in REFUSED.items()}
    ref = hf_causal_lm(folder, dtype=torch.float32)
    ids = torch.randint(3, 203, (2, 32), generator=torch.Generator().manual_seed(7))
    for name, layout in LAYOUTS.items():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        for seq in (32, 16):
            x = ids[:, :seq]
            with torch.no_grad():
                ours = model(input_ids=x, labels=x, output_router_logits=True)
                theirs = ref(input_ids=x, labels=x, output_router_logits=True)
            out[f"{name}_{seq}"] = {
                "logits": (ours.logits - theirs.logits).abs().max().item(),
                "loss": abs(ours.loss.item() - theirs.loss.item()),
                "router_counts": (len(ours.router_logits), len(theirs.router_logits)),
                "router": max((a - b).abs().max().item() for a, b in zip(ours.router_logits, theirs.router_logits)),
                "aux": abs(ours.aux_loss.item() - theirs.aux_loss.item())}
        if name == "tp1":
            out.update(_padded_and_generate(model, ref, ids))
            out.update(_hub_checks(folder, ref, ids))
        else:
            model.save_pretrained(f"{folder}-{name}")
            dist.barrier()
            out[f"{name}_export"] = _exported_equal(folder, f"{folder}-{name}")
        if name == "tp2sp":
            out["grads"] = _gradients(model, folder, ids)
        if name == "cp2":  # NOTE: _gradients writes the gradients over the weights: last
            out["cp2_padded"] = _padded_and_generate(model, ref, ids)
            out["cp2_grads"] = _gradients(model, folder, ids, "-cp2")
            out["cp2_packed_training"] = _packed_training(model, f"{folder}-cp2-packed", ids)
        if name.startswith("pp2"):
            out[f"{name}_step"] = _pipeline_step(model, folder, ids)
        del model
    out["sequential"] = _sequential_experts(folder, ref, ids)
    return out


def _sequential_experts(folder: str, ref, ids: torch.Tensor) -> dict:
    """The routed experts as megatron's SequentialMLP with its clamped GLU (``LOONGFORGE_MOE_GROUPED_GEMM=0``) at
    EP2: logits against transformers'; the default's experts are the grouped MLP."""
    import os

    import loongforge_hf as lf
    from loongforge_hf.bridges.moe import GROUPED_GEMM_ENV

    kinds = {}
    for value in ("1", "0"):
        os.environ[GROUPED_GEMM_ENV] = value
        try:
            model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **LAYOUTS["ep2"])
        finally:
            del os.environ[GROUPED_GEMM_ENV]
        kinds[value] = type(model.chunks[0].decoder.layers[0].mlp.experts).__name__
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    return {"logits": diff, "experts": kinds}


def _beam(folder: str) -> dict:
    """Beam at TP1 (and cached generate), TP2 + SP x EP2, PP2 and CP2: logits, loss, ``router_logits``; gradients
    and export at TP2 + SP x EP2, gradients at CP2, LoongTrainer's step with every gradient at PP2."""
    import torch.distributed as dist

    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    out, ref = {}, hf_causal_lm(folder, dtype=torch.float32)
    ids = torch.randint(3, 203, (2, 32), generator=torch.Generator().manual_seed(7))
    for name in ("tp1", "tp2sp_ep2", "pp2", "cp2"):
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **LAYOUTS[name])
        with torch.no_grad():
            ours = model(input_ids=ids, labels=ids, output_router_logits=True)
            theirs = ref(input_ids=ids, labels=ids, output_router_logits=True)
        out[name] = {"logits": (ours.logits - theirs.logits).abs().max().item(),
                     "loss": abs(ours.loss.item() - theirs.loss.item()),
                     "router_counts": (len(ours.router_logits), len(theirs.router_logits)),
                     "router": max((a - b).abs().max().item() for a, b in zip(ours.router_logits,
                                                                              theirs.router_logits))}
        if name == "tp1":  # NOTE: cached greedy generate, one row left-padded (the query scale at each slot)
            mask = torch.ones_like(ids[:, :12])
            mask[0, :4] = 0
            out["generate"] = torch.equal(model.generate(ids[:, :12], attention_mask=mask, max_new_tokens=8,
                                                         do_sample=False),
                                          ref.generate(ids[:, :12], attention_mask=mask, max_new_tokens=8,
                                                       do_sample=False))
        if name == "tp2sp_ep2":
            model.save_pretrained(f"{folder}-out")
            dist.barrier()
            out["export"] = _exported_equal(folder, f"{folder}-out")
            out["grads"] = _gradients(model, folder, ids)
        if name == "pp2":
            out["pp2_step"] = _pipeline_step(model, folder, ids)
        if name == "cp2":
            out["cp2_grads"] = _gradients(model, folder, ids, "-cp2")
        del model
    return out


def lora_checks(folder: str, name: str, layout: dict, lora_kw: dict, reload: bool = False,
                scale_saved: float | None = None) -> dict:
    """LoRA against PEFT under ``layout`` (``_lora_parity.lora_against_peft``: logits, loss, every adapter's gradient,
    the adapter folder in PEFT) and the merged export read by transformers (rank 0: its logits against ours); with
    ``reload`` the adapter folder loaded onto a fresh model (``load_adapter``; its logits against PEFT's with that
    folder) and ``unload()`` (the base model's logits against transformers'); ``scale_saved`` as
    ``lora_against_peft``'s."""
    import torch.distributed as dist

    from loongforge_hf.testing.tiny_models import hf_causal_lm
    from tests.bridges._lora_parity import lora_against_peft

    def reloaded() -> dict:
        import peft

        import loongforge_hf as lf
        from loongforge_hf.lora.load import load_adapter

        ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
        model = load_adapter(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
                             f"{folder}-lora-{name}/adapter")
        with torch.no_grad():
            ours = model(input_ids=ids).logits
            base = model.unload()(input_ids=ids).logits
        if dist.get_rank() != 0:
            return {}
        hf = hf_causal_lm(folder, dtype=torch.float32)
        with torch.no_grad():
            plain = hf(input_ids=ids).logits
            theirs = peft.PeftModel.from_pretrained(hf, f"{folder}-lora-{name}/adapter")(input_ids=ids).logits
        return {"reloaded_logits": float((ours - theirs).abs().max()),
                "unloaded_logits": float((base - plain).abs().max())}

    def merged(model):
        ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
        # NOTE: after the backward: megatron's overlapped gradient reduction waits for a gradient of each trainable
        # tensor; those the bridge marks takes_no_gradient (the indexers') stay frozen under modules_to_save
        named = list(model.named_parameters())
        trained = {"no_gradient": [n for n, p in named if p.requires_grad and p.grad is None],
                   "frozen": [n for n, p in named if getattr(p, "takes_no_gradient", False) and not p.requires_grad]}
        model.save_pretrained(f"{folder}-lora-{name}-merged", merged=True)
        with torch.no_grad():
            ours = model(input_ids=ids).logits
        if dist.get_rank() != 0:
            return trained
        with torch.no_grad():
            theirs = hf_causal_lm(f"{folder}-lora-{name}-merged", dtype=torch.float32)(input_ids=ids).logits
        return {**trained, "merged_logits": float((ours - theirs).abs().max())}

    out = lora_against_peft(folder, f"{folder}-lora-{name}", layout, lora_kw, merged, scale_saved)
    dist.barrier()  # NOTE: the adapter folder is written by the first rank
    return {**out, **(reloaded() if reload else {})}


def lora_training(folder: str, layout: dict, lora_kw: dict, **overrides) -> dict:
    """LoongSFTTrainer with LoRA under ``layout``: 4 steps checkpointing at step 2, resumed from checkpoint-2 in the
    same layout and at TP1 (the same global batch: one row a rank); the last checkpoint's adapter folder in PEFT
    (rank 0: its logits against ours with that folder, ``load_adapter`` at TP1). ``overrides``: SFTConfig fields."""
    import peft
    import torch.distributed as dist

    import loongforge_hf as lf
    from loongforge_hf.lora.load import load_adapter
    from loongforge_hf.testing.tiny_models import hf_causal_lm
    from tests.integrations._sft_parity import resume_matches_uninterrupted

    out_dir = f"{folder}-lora-training"
    out = resume_matches_uninterrupted(folder, out_dir, layout, lora_kw, other_layout={},
                                       other_overrides={"per_device_train_batch_size": 1}, **overrides)
    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model = load_adapter(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                         f"{out_dir}/checkpoint-4")
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    if dist.get_rank() == 0:
        hf = hf_causal_lm(folder, dtype=torch.float32)
        with torch.no_grad():
            base = hf(input_ids=ids).logits
            theirs = peft.PeftModel.from_pretrained(hf, f"{out_dir}/checkpoint-4")(input_ids=ids).logits
        out.update(adapter_logits=float((ours - theirs).abs().max()), trained=float((theirs - base).abs().max()))
    return out


def _indexer_lora(folder: str) -> dict:
    """LoRA on the indexer's linears (TP1) against PEFT: logits and loss, no gradient reaching those adapters on
    either side (the indexer only picks the top-k), and the adapter folder in PEFT (its logits against ours)."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(5)
    model = get_peft_model(model, peft.LoraConfig(**INDEXER_LORA_KW))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(5)
    ref = peft.get_peft_model(hf, peft.LoraConfig(**INDEXER_LORA_KW))
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    grads = []  # NOTE: adapters that take a gradient; a loss reaching none of them has no graph (ours)
    for out, side in ((ours, model), (theirs, ref)):
        if out.loss.requires_grad:
            out.loss.backward()
            grads += [n for n, p in side.named_parameters() if "lora" in n and p.grad is not None]
    model.save_pretrained(f"{folder}-lora-indexer")
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), f"{folder}-lora-indexer")
    with torch.no_grad():
        adapter_logits = float((loaded(input_ids=ids).logits - ours.logits).abs().max())
    return {"logits": float((ours.logits - theirs.logits).abs().max()), "loss": float(abs(ours.loss - theirs.loss)),
            "adapter_logits": adapter_logits, "targets": len(model.lora_plan.targets), "grads": grads}


# NOTE: init_lora_weights=False keeps B random, so every adapter moves the logits; the grouped o_a_proj is refused;
# the indexer's adapters take no gradient (PEFT's None), checked on their own (``_indexer_lora``)
# the routed experts' stacks and the router as target_parameters (PEFT's ParamWrapper)
ROUTED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
LORA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=r".*(o_a_proj|\.indexer\..*)",
               init_lora_weights=False, target_parameters=ROUTED)
# NOTE: the indexer's adapters and its compressor's norm (a modules_to_save "norm") take no gradient: kept frozen
TRAINING_LORA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["o_a_proj"],
                        modules_to_save=["norm"], target_parameters=ROUTED)
INDEXER_LORA_KW = dict(r=4, lora_alpha=8, target_modules=r".*\.indexer\.(kv_proj|gate_proj|q_b_proj|scorer\..*)",
                       init_lora_weights=False)


def _both(folders: dict) -> dict:
    out = {**_world(folders["deepseek_v4"]), "beam": _beam(folders["beam"])}
    for name in ("tp1", "tp2sp_ep2"):
        out[f"lora_{name}"] = lora_checks(folders["deepseek_v4"], name, LAYOUTS[name], LORA_KW, name != "tp1")
    out["lora_indexer"] = _indexer_lora(folders["deepseek_v4"])
    # NOTE: without the balancing loss, which is taken per micro-batch (two rows at TP2, one a rank at TP1)
    out["lora_training"] = lora_training(folders["deepseek_v4"], LAYOUTS["tp2sp_ep2"], TRAINING_LORA_KW,
                                         router_aux_loss_coef=0.0)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("v4")
    folders = {arch: str(make_tiny_checkpoint(root / arch, arch)) for arch in ("deepseek_v4", "beam")}
    return run_distributed(_both, 2, folders, timeout=500)[0]


@pytest.mark.parametrize("name", [f"{layout}_{seq}" for layout in LAYOUTS for seq in (32, 16)])
def test_logits_loss_and_router_logits_match_transformers(results, name):
    r = results[name]
    assert r["logits"] < 1e-4 and r["loss"] < 1e-4, r
    # NOTE: the top-k layers' only, as transformers; the balancing loss (coefficient 0.001) is in the loss too
    assert r["router_counts"] == (2, 2) and r["router"] < 1e-5 and r["aux"] < 1e-5, r


@pytest.mark.parametrize("key", ["grads", "cp2_grads"])
def test_gradients_at_tp2_sp_and_cp2_match_transformers(results, key):
    """TP2 + SP (attention replicated) and CP2 (each rank's queries over the whole sequence's keys, the input's
    gradient summed back to each rank's share): every gradient within 1e-4 of its largest entry."""
    diffs = results[key]
    assert diffs and max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


def test_left_padding_and_generate_under_cp2(results):
    """CP2: megatron's mask rows of the rank's queries over the whole sequence's keys (a left-padded row's real
    tokens' logits), greedy ``generate(use_cache=False)`` (a 14-token prompt, padded to a multiple of 4 with a pad
    document of its own at the end: not taken for packing), packed documents still refused: by the forward and by
    LoongTrainer's batch check on every rank (the whole batch, before the CP split)."""
    r = results["cp2_padded"]
    assert r["padded"] < 1e-4 and r["generate"], r
    assert "position_ids other than 0..s-1 (packed documents) are not supported" in r["packed_refusal"], r
    assert results["cp2_packed_training"].startswith("DataError: ") and "position_ids other than 0..s-1 (packed " \
        "documents) are not supported for DeepseekV4ForCausalLM" in results["cp2_packed_training"], results


def test_sequential_experts_match_transformers(results):
    r = results["sequential"]
    assert r["experts"] == {"1": "GroupedMLP", "0": "SequentialMLP"} and r["logits"] < 1e-4, r


def test_hub_names_load_and_export_as_transformers_writes(results):
    assert results["hub_logits"] < 1e-4 and results["hub_export"] == {"same_names": True, "unequal": []}, results


def test_left_padding_generate_without_cache_and_refusals(results):
    assert results["padded"] < 1e-4 and results["generate"], results
    assert "KV cache is not supported for DeepseekV4ForCausalLM" in results["cache_refusal"], results
    assert "position_ids other than 0..s-1 (packed documents) are not supported for DeepseekV4ForCausalLM" in \
        results["packed_refusal"], results


@pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2"])
def test_trainer_step_and_gradients_through_pipeline_stages_match_transformers(results, layout):
    """The hyper-connections' streams cross the stage boundaries forward and backward (LoongTrainer's step; megatron's
    interleaved schedule at PP2 x VPP2)."""
    r = results[f"{layout}_step"]
    assert "activation recompute with pipeline_parallel_size=2 is not supported for DeepseekV4ForCausalLM: its " \
        "hash-routed layers" in r["recompute_refusal"], r["recompute_refusal"]
    assert r["loss"] < 1e-4 and r["grad_norm"] < 1e-4, r
    assert r["grads"] and max(r["grads"].values()) < 1e-4, sorted(r["grads"].items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("layout", ["tp2sp", "ep2", "tp2sp_ep2", "pp2", "pp2_vpp2", "cp2"])
def test_export_is_bit_exact(results, layout):
    assert results[f"{layout}_export"] == {"same_names": True, "unequal": []}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_layouts_refused_by_name_before_any_collective(results, name):
    r = results[name]
    assert r["type"] in ("UnsupportedConfigError", "ParallelLayoutError") and not r["collective_started"], r
    assert re.search(re.escape(REFUSED[name][1]) + (".*DeepseekV4ForCausalLM" if name != "tp2" else ""),
                     r["message"]), r


@pytest.mark.parametrize("overrides,field", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"o_groups": 3}, "o_groups=3"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                          "compress": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0,
                                       "partial_rotary_factor": 0.25}}}, "rope_parameters['compress']"),
])
def test_fields_not_reproduced_refused_by_name(overrides, field):
    """Pure checks (no process group): what the bridge does not reproduce is refused naming the field."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    with pytest.raises(UnsupportedConfigError, match=re.escape(field) + ".*DeepseekV4ForCausalLM"):
        get_bridge(_config("deepseek_v4", **overrides))


@pytest.mark.parametrize("layout", ["tp1", "tp2sp_ep2", "pp2", "cp2"])
def test_beam_logits_loss_and_router_logits_match_transformers(results, layout):
    r = results["beam"][layout]
    assert r["logits"] < 1e-4 and r["loss"] < 1e-4, r
    assert r["router_counts"] == (3, 3) and r["router"] < 1e-5, r


def test_beam_gradients_and_export_at_tp2_sp_ep2_and_cached_generate(results):
    r = results["beam"]
    assert r["generate"], r
    assert r["export"] == {"same_names": True, "unequal": []}, r["export"]
    assert r["grads"] and max(r["grads"].values()) < 1e-4, sorted(r["grads"].items(), key=lambda kv: -kv[1])[:5]


def test_beam_pipeline_step_and_cp2_gradients(results):
    """PP2: LoongTrainer's step (loss, gradient norm, every gradient through the stages); CP2: every gradient."""
    step, grads = results["beam"]["pp2_step"], results["beam"]["cp2_grads"]
    assert step["loss"] < 1e-4 and step["grad_norm"] < 1e-4, step
    assert step["grads"] and max(step["grads"].values()) < 1e-4, sorted(step["grads"].items(), key=lambda kv: -kv[1])
    assert grads and max(grads.values()) < 1e-4, sorted(grads.items(), key=lambda kv: -kv[1])[:5]


def test_beam_rope_on_full_layers_refused_by_name():
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(UnsupportedConfigError, match=re.escape("rope_parameters['full_attention']") +
                       ".*BeamForCausalLM"):
        get_bridge(_config("beam", rope_parameters=rope))


def test_pipeline_and_context_parallel_accepted_by_the_pure_layout_check():
    """Neither bridge refuses PP, VPP or CP (the worlds above run them); DeepSeek-V4's stage boundary carries its
    streams, which needs megatron's per-message shape exchange."""
    from loongforge_hf.bridges.builder import check_megatron_config
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("deepseek_v4"))
    assert not hasattr(bridge, "check_layout") and not hasattr(get_bridge(_config("beam")), "check_layout")
    assert bridge.pipeline_hidden_size() == 3 * bridge.hf_config.hidden_size
    with pytest.raises(ValueError, match="variable_seq_lengths=False: DeepseekV4ForCausalLM's pipeline stages send "
                                         "192 values per token, not hidden_size=64"):
        check_megatron_config(bridge, {"variable_seq_lengths": False})


@pytest.mark.parametrize("name", ["tp1", "tp2sp_ep2"])
def test_lora_matches_peft_and_exports(results, name):
    """'all-linear' but the grouped o_a_proj and the indexer: the attention's replicated linears (compressors' too)
    and the shared experts; the routed experts' stacks (target_parameters, whole experts per EP rank) and the
    routers (the top-k layers' sqrtsoftplus and the hash layers', whose logits weigh the experts the ids pick)."""
    r = results[f"lora_{name}"]
    assert r["logits"] < 1e-4 and r["loss"] < 1e-4 and r["grads"] < 1e-4, r
    # NOTE: the expert stacks' adapters: PEFT's names end in experts (down_proj's) and experts.base_layer
    # (gate_up_proj's, the first ParamWrapper), the router's in gate; 4 layers x 3 x A / B of the 92
    assert r["graded"] == 92 and r["targets"] == ["base_layer", "down_proj", "experts", "gate", "gate_proj",
                                                  "kv_proj", "o_b_proj", "q_a_proj", "q_b_proj", "up_proj"], r
    assert r["adapter_logits"] < 1e-4 and r["inspected"]["merged_logits"] < 1e-4, r
    assert r["inspected"]["no_gradient"] == [], r
    if name != "tp1":  # NOTE: the folder loaded onto a fresh model split over TP and EP, then unloaded
        assert r["reloaded_logits"] < 1e-4 and r["unloaded_logits"] < 1e-4, r


def test_lora_on_the_indexer_matches_peft_without_gradient(results):
    r = results["lora_indexer"]  # NOTE: layers 1 and 3: the indexer's compressor kv / gate, q_b_proj, weights_proj
    assert r["targets"] == 8 and r["grads"] == [], r
    assert r["logits"] < 1e-4 and r["loss"] < 1e-4 and r["adapter_logits"] < 1e-4, r


def test_lora_refusals_by_the_pure_planner(monkeypatch):
    import peft

    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("deepseek_v4"))  # NOTE: o_a_proj's: tests/integrations/test_lora_refused_by_name.py
    monkeypatch.setenv("LOONGFORGE_MOE_GROUPED_GEMM", "0")  # NOTE: megatron's SequentialMLP
    with pytest.raises(LoraConfigError, match="LoRA on the routed experts needs loongforge's grouped expert MLP"):
        plan_lora(get_bridge(_config("deepseek_v4")),
                  peft.LoraConfig(r=4, target_modules=["q_a_proj"], target_parameters=ROUTED))
    with pytest.raises(LoraConfigError, match=r"use_dora=True and init_lora_weights='pissa' is not supported on "
                                              r"\['q_a_proj'\] \(linears of the bridge's"):
        plan_lora(bridge, peft.LoraConfig(r=4, target_modules=["q_a_proj"], use_dora=True, init_lora_weights="pissa"))


def test_peft_itself_fails_on_the_grouped_output_projection():
    """Why o_a_proj is refused: PEFT's LoRA layer on transformers' DeepseekV4GroupedLinear fails in the forward."""
    import peft
    import transformers

    from loongforge_hf.testing.tiny_models import _config

    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(_config("deepseek_v4")),
                                peft.LoraConfig(r=4, target_modules=["o_a_proj"]))
    with pytest.raises(RuntimeError):
        model(input_ids=torch.ones(1, 8, dtype=torch.long))


def test_lora_training_resumes_from_its_checkpoint(results):
    """LoongSFTTrainer at TP2 + SP x EP2 ('all-linear' but o_a_proj, the norms saved; the indexer's adapters and
    norm frozen, no gradient as in PEFT), rows shorter than a compression window included: the run resumed from
    checkpoint-2 logs the uninterrupted run's losses exactly, resumed at TP1 (the same global batch; without the
    balancing loss, taken per micro-batch) within 1e-5 relative; the last checkpoint's adapter folder in PEFT gives
    our logits (1e-4) and moves transformers'."""
    r = results["lora_training"]
    assert [s for s, _ in r["full"]] == [1, 2, 3, 4] and r["resumed"] == r["full"], r
    assert [s for s, _ in r["other"]] == [1, 2, 3, 4], r
    assert [loss for _, loss in r["other"]] == pytest.approx([loss for _, loss in r["full"]], rel=1e-5), r
    assert {"adapter_model.safetensors", "adapter_config.json", "megatron"} <= set(r["checkpoint_files"]), r
    assert r["adapter_logits"] < 1e-4 and r["trained"] > 1e-3, r
