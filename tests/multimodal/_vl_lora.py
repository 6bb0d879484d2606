"""Rank functions for test_qwen2_5_vl_lora.py and test_qwen3_vl_lora.py: LoRA on Qwen2.5-VL / Qwen3-VL against PEFT
(and TRL) on the transformers model (its class from the checkpoint's config: ``AutoModelForImageTextToText``)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..integrations._lora_checks import lora_pair
from ._vl_parity import make_batch, train_features, vl_training_args

# init_lora_weights=False keeps B random, so every adapter changes the logits
CONFIGS = {
    # the language model's q/v projections only (the tower's attention is one fused `qkv`), rsLoRA
    "language_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        use_rslora=True),
    # every linear but the LM head, the tower's (ViT attention and MLP, patch merger) included, as PEFT's
    # "all-linear"; the LM head and the language norms trained whole. NOTE: scaling 1: with random B at a larger
    # scaling the tower's activations grow until its attention amplifies fp32 rounding (at rsLoRA's 4 the logits
    # differ from PEFT's by 1e-4, at 2 by 2e-6, at 1 by 9e-7; the base model's by 3e-7)
    "all_linear": dict(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False,
                       modules_to_save=["lm_head", "post_attention_layernorm"]),
    # DoRA on the language model's attention, and on every linear (the tower's too) at scaling 1 (see all_linear)
    "language_dora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False,
                          use_dora=True),
    "all_linear_dora": dict(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False, use_dora=True),
}
GRAD_TOL = 2e-5
SPLIT_TOWER = {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2}


def _check_grads(model, ref, tol: float = GRAD_TOL, worst: list | None = None) -> dict:
    """Every adapter's gradient against PEFT's (one pipeline stage), within ``tol`` of its largest entry: the tower's
    whole, the language model's as this TP rank holds them (B's rows of a column-parallel target, A's columns of a
    row-parallel one); the counts of each, and the largest relative difference in ``worst`` (a list, appended)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora.model import _layout_and_slices
    from loongforge_hf.lora.vision import chunk_params, local_factors, text_bridge, tower_split

    ref_params = dict(ref.named_parameters())
    ours = chunk_params(model.chunks[0])
    ctx = shard_context(text_bridge(model), tp_rank=ps.get_tensor_model_parallel_rank(),
                        tp_size=ps.get_tensor_model_parallel_world_size(), padded_vocab=model.megatron.padded_vocab)
    counts, largest = {"vision": 0, "language": 0}, 0.0
    for t in model.lora_plan.targets:
        if t.kind in ("experts", "router"):  # NOTE: PEFT's target_parameters (Qwen3-VL-MoE): _check_param_grads
            continue
        module = t.megatron_module.format(layer=t.layer)
        got = [ours[f"{module}.lora.{t.name}.{f}"].grad for f in "AB"]
        want = [ref_params[f"base_model.model.{t.hf_module}.lora_{f}.default.weight"].grad for f in "AB"]
        if all(w is None for w in want):  # NOTE: LLaVA's ViT blocks after its feature layer: PEFT's none, ours zero
            assert all(g is None or not g.any() for g in got), t.hf_module
            counts["idle"] = counts.get("idle", 0) + 1
            continue
        if t.kind == "vision" and model.vision_layout == "tensor_parallel":
            want = list(local_factors(tower_split(t), *want, ps.get_tensor_model_parallel_rank(),
                                      ps.get_tensor_model_parallel_world_size()))
        elif t.kind != "vision":
            _, slices = _layout_and_slices([t], ctx, t.layer)
            if t.kind == "row":
                want[0] = want[0][:, slices[t.name]]
            else:
                want[1] = want[1][slices[t.name]]
        for f, a, b in zip("AB", got, want):
            # NOTE: within 2e-5 of the tensor's largest entry (measured: up to ~3e-6 for the tower's adapters,
            # whose attention runs other kernels than transformers' eager one)
            diff, scale = float((a - b).abs().max()), float(b.abs().max())
            assert scale > 0 and diff <= tol * scale, (f"d{f} {t.hf_module}", diff, scale)
            largest = max(largest, diff / scale)
        counts["vision" if t.kind == "vision" else "language"] += 1
    if any(t.kind in ("experts", "router") for t in model.lora_plan.targets):
        counts["params"] = _check_param_grads(model, ref)
    if worst is not None:
        worst.append(largest)
    return counts


def _check_param_grads(model, ref) -> int:
    """The routed experts' and routers' adapters (PEFT's ``target_parameters``, every MoE layer, one pipeline stage)
    against PEFT's gradients, within GRAD_TOL of the largest entry: the router's whole (summed over the TP ranks that
    split the tokens under SP, as megatron sums them), an expert stack's this expert-parallel rank's experts (summed
    over the expert-data-parallel replicas, each with its own tokens; PEFT's times the data-parallel ranks, which all
    feed the same batch to these experts)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.lora.experts import megatron_factors
    from loongforge_hf.lora.vision import chunk_params

    ref_params, ours = dict(ref.named_parameters()), chunk_params(model.chunks[0])
    dp = ps.get_data_parallel_world_size()
    ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    checked = 0
    for t in model.lora_plan.targets:
        if t.kind not in ("experts", "router"):
            continue
        want = [ref_params[f"base_model.model.{t.hf_module}.lora_{f}.default.weight"].grad for f in "AB"]
        module = t.megatron_module.format(layer=t.layer)
        got = [ours[f"{module}.lora.{t.name}.{f}"].grad.clone() for f in "AB"]
        if t.kind == "router":
            if model.megatron.config.sequence_parallel:
                for g in got:
                    dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        else:
            if ps.get_expert_data_parallel_world_size() > 1:
                for g in got:
                    dist.all_reduce(g, group=ps.get_expert_data_parallel_group())
            per = t.num_experts // ep
            local = slice(ep_rank * per, (ep_rank + 1) * per)
            want = [dp * g[local] for g in megatron_factors(t, *want)]  # NOTE: Llama 4's swapped factors too
        for f, a, b in zip("AB", got, want):
            diff, scale = float((a - b).abs().max()), float(b.abs().max())
            assert scale > 0 and diff <= GRAD_TOL * scale, (f"d{f} {t.hf_module}", diff, scale)
            checked += 1
    return checked


def _sum_over_context_parallel(model) -> None:
    """Each CP rank's gradients are its sequence share's (and its share of the images'): megatron's DDP sums them."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_context_parallel_group())


def padded_batch(folder: str) -> dict:
    return make_batch(folder, pad_to_multiple_of=4)  # NOTE: CP2 takes lengths that divide by 2 x CP


def model_checks(folder: str, out_dir: str, layout: dict, name: str, configs: dict | None = None,
                 batch_for=padded_batch, grad_tol: float = GRAD_TOL) -> dict:
    """Logits, loss, adapter gradients (one stage, ``_check_grads`` within ``grad_tol``), PEFT's counts; the adapter
    folder in PEFT and the merged export in transformers (differences from our logits, rank 0),
    ``adapter_config.json``'s target_modules against PEFT's (the LoraConfig ``configs[name]``, ``CONFIGS`` by default;
    the batch ``batch_for(folder)``)."""
    batch = batch_for(folder)
    model, _, ref = lora_pair(folder, layout, (configs or CONFIGS)[name], image_text=True)
    ours, theirs = model(**batch), ref(**batch)
    result = {"counts": model.get_nb_trainable_parameters(), "peft_counts": ref.get_nb_trainable_parameters(),
              "logits_diff": float((ours.logits - theirs.logits).abs().max()),
              "loss_diff": float((ours.loss - theirs.loss).abs())}
    if model.parallel.pipeline_parallel_size == 1:
        ours.loss.backward()
        theirs.loss.backward()
        _sum_over_context_parallel(model)
        worst: list[float] = []
        result["grads_checked"] = _check_grads(model, ref, grad_tol, worst)
        result["grad_worst"] = worst[0]
        model.zero_grad(set_to_none=True)
    result.update(export_checks(model, ref, folder, out_dir, batch, ours.logits.detach()))
    return result


def export_checks(model, ref, folder: str, out_dir: str, batch: dict, logits: torch.Tensor) -> dict:
    """After the forward that gave ``logits``: our adapter folder and merged export written (every rank), the model
    unchanged by the merged export; rank 0: PEFT's folder beside ours, ``target_modules`` as each wrote them, the
    adapter tensors' count and whether their names and shapes are PEFT's, our adapter folder in
    ``PeftModel.from_pretrained`` and our merged export in transformers (differences from ``logits``)."""
    import peft
    import transformers
    from safetensors import safe_open

    model.save_pretrained(f"{out_dir}/adapter")
    model.save_pretrained(f"{out_dir}/merged", merged=True)
    with torch.no_grad():
        result = {"unchanged_after_merged_export": torch.equal(model(**batch).logits, logits)}
    if dist.get_rank() == 0:
        ref.save_pretrained(f"{out_dir}/peft")
        written = [json.load(open(f"{out_dir}/{d}/adapter_config.json"))["target_modules"] for d in ("adapter", "peft")]
        result["target_modules"] = written
        # the tensors' names (PEFT's: the module tree's) and shapes as PEFT writes them
        files = [safe_open(f"{out_dir}/{d}/adapter_model.safetensors", "pt") for d in ("adapter", "peft")]
        shapes = [{k: f.get_slice(k).get_shape() for k in f.keys()} for f in files]
        result["adapter_tensors"] = (len(shapes[0]), shapes[0] == shapes[1])
        with torch.no_grad():
            base = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
            loaded = peft.PeftModel.from_pretrained(base, f"{out_dir}/adapter")
            result["adapter_logits_diff"] = float((loaded(**batch).logits - logits).abs().max())
            merged = transformers.AutoModelForImageTextToText.from_pretrained(f"{out_dir}/merged", dtype=torch.float32)
            result["merged_logits_diff"] = float((merged(**batch).logits - logits).abs().max())
    return result


def save_naming_base(peft_model, adapter: str, folder: str) -> None:
    """``peft_model``'s adapter folder, its ``base_model_name_or_path`` the local checkpoint ``folder``."""
    peft_model.save_pretrained(adapter)
    config = json.load(open(f"{adapter}/adapter_config.json"))
    json.dump({**config, "base_model_name_or_path": folder}, open(f"{adapter}/adapter_config.json", "w"))


def peft_adapter_checks(folder: str, out_dir: str, layout: dict, saved: tuple = ("lm_head", "norm"),
                        multiple: int | None = None, lora_alpha: int = 8, batch: dict | None = None) -> dict:
    """A PEFT-written adapter ("all-linear" at r 2, random B, norms and LM head whole: ``saved`` its modules_to_save)
    loaded here: ``from_pretrained`` of the adapter folder (frozen) and ``load_adapter(..., is_trainable=True)`` against
    ``PeftModel.from_pretrained``; then ``disable_adapter`` and ``merge_and_unload`` against PEFT's (differences of
    logits; ``batch``, else the processor's padded to a ``multiple`` of tokens when given, as sequence parallelism
    needs)."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import load_adapter

    batch = batch if batch is not None else make_batch(folder, pad_to_multiple_of=multiple)
    adapter = f"{out_dir}/peft-written"
    if dist.get_rank() == 0:
        hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        transformers.set_seed(1)
        peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=lora_alpha, target_modules="all-linear",
                                                             init_lora_weights=False,
                                                             modules_to_save=list(saved)))
        save_naming_base(peft_model, adapter, folder)
    dist.barrier()
    with torch.no_grad():
        ref = peft.PeftModel.from_pretrained(
            transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32), adapter)
        expected = ref(**batch).logits
        with ref.disable_adapter():
            expected_base = ref(**batch).logits
        frozen = lf.AutoModelForImageTextToText.from_pretrained(adapter, dtype=torch.float32, **layout)
        out = {"class": type(frozen).__name__, "trainable": sum(p.requires_grad for p in frozen.parameters()),
               "logits_diff": float((frozen(**batch).logits - expected).abs().max())}
        model = load_adapter(lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout),
                             adapter, is_trainable=True)
        out["trainable_counts"] = model.get_nb_trainable_parameters()
        with model.disable_adapter():
            out["disabled_diff"] = float((model(**batch).logits - expected_base).abs().max())
        merged = model.merge_and_unload()
        out["merged_class"] = type(merged).__name__
        out["merged_diff"] = float((merged(**batch).logits - expected).abs().max())
    return out


def check_peft_adapter(res: dict) -> None:
    """``peft_adapter_checks``' result: the adapter folder loads frozen as a LoRA model, ``load_adapter`` trains it,
    ``disable_adapter`` and ``merge_and_unload`` give PEFT's logits (1e-5; merged 3e-5: test_qwen2_5_vl_lora.py says
    why)."""
    assert res["class"] == "LoongLoraModelForImageTextToText" and res["trainable"] == 0, res
    assert res["merged_class"] == "LoongModelForImageTextToText", res
    assert res["trainable_counts"][0] > 0, res
    assert max(res["logits_diff"], res["disabled_diff"]) < 1e-5 and res["merged_diff"] < 3e-5, res


def two_rank_checks(folder: str, out_dir: str) -> dict:
    out = {f"{layout_name}/{name}": model_checks(folder, f"{out_dir}/{layout_name}-{name}", layout, name)
           for layout_name, layout in (("tp2", {"tensor_parallel_size": 2}), ("pp2", {"pipeline_parallel_size": 2}),
                                       ("cp2", {"context_parallel_size": 2}),
                                       ("tp2_encoder_dp", {"tensor_parallel_size": 2, "vision_data_parallel": True}))
           for name in CONFIGS}
    # the tower split over TP: its adapters split as its weights
    out["tp2_split_tower/all_linear"] = model_checks(
        folder, f"{out_dir}/split-all_linear", SPLIT_TOWER, "all_linear")
    out["peft_adapter"] = peft_adapter_checks(folder, out_dir, {"tensor_parallel_size": 2})
    out["peft_dora"] = peft_dora_checks(folder, out_dir, {"tensor_parallel_size": 2})
    out["resume"] = resume_matches_uninterrupted(folder, f"{out_dir}/resume", SPLIT_TOWER,
                                                 {"pipeline_parallel_size": 2})
    return out


SFT_LORA = dict(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def sft_losses(folder: str, out_dir: str, loong: bool, features_for=train_features) -> list[float]:
    """3 steps of LoRA ("all-linear", PEFT's initialisation) through LoongSFTTrainer or trl.SFTTrainer + PEFT on the
    transformers model, the same SFTConfig, rows of processor outputs (``features_for(folder)``) and collator: the
    logged losses."""
    import datasets
    import peft
    import transformers
    import trl
    from transformers import AutoTokenizer

    import loongforge_hf as lf
    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_vl import processor_for

    tok = AutoTokenizer.from_pretrained(folder)
    args = trl.SFTConfig(**{**vl_training_args(out_dir).to_dict(), "hub_token": None, "learning_rate": 2e-2,
                            "dataset_kwargs": {"skip_prepare_dataset": True}})
    rows = datasets.Dataset.from_list([{k: v.tolist() for k, v in f.items()} for f in features_for(folder)])
    collator = DataCollatorForImageText.from_processor(processor_for(folder))
    if loong:
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=rows, data_collator=collator,
                                     processing_class=tok, peft_config=peft.LoraConfig(**SFT_LORA))
    else:
        model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows, data_collator=collator,
                                 processing_class=tok, peft_config=peft.LoraConfig(**SFT_LORA))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def refusals(folder: str, tower_module: str = "merger.ln_q") -> dict:
    """What LoRA on the image-text model refuses (the messages), the model unchanged after each (``tower_module``: a
    module of the tower named in modules_to_save)."""
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model
    from loongforge_hf.lora.plan import LoraConfigError

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    out = {}
    for name, kw in {"tower_saved": dict(target_modules=["q_proj"], modules_to_save=[tower_module]),
                     "tokens": dict(target_modules=["q_proj"], trainable_token_indices=[5, 6])}.items():
        try:
            get_peft_model(model, peft.LoraConfig(**kw))
            out[name] = "not refused"
        except LoraConfigError as err:
            out[name] = str(err)
        assert type(model).__name__ == "LoongModelForImageTextToText" and all(p.requires_grad for p in
                                                                              model.parameters())
    return out


def generate_matches(folder: str) -> tuple[bool, float]:
    """Greedy cached ``generate`` (images of two sizes, left padding, a text-only row) with "all-linear" adapters
    against PEFT's model's: same tokens, largest score difference."""
    from ._vl_generate import prompt_batch

    model, _, ref = lora_pair(folder, {}, CONFIGS["all_linear"], image_text=True)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        ours, theirs = model.generate(**prompt_batch(folder), **kw), ref.generate(**prompt_batch(folder), **kw)
    diff = (torch.stack(ours.scores) - torch.stack(theirs.scores)).abs().max()
    return torch.equal(ours.sequences, theirs.sequences), float(diff)


def one_rank_checks(folder: str, out_dir: str) -> dict:
    out = {name: model_checks(folder, f"{out_dir}/{name}", {}, name) for name in CONFIGS}
    out["generate"] = generate_matches(folder)
    out["refused"] = refusals(folder)
    out["sft"] = {"trl": sft_losses(folder, out_dir + "/trl", loong=False),
                  "loong": sft_losses(folder, out_dir + "/loong", loong=True)}
    return out


def resume_matches_uninterrupted(folder: str, out_dir: str, layout: dict, resume_layout: dict,
                                 use_cpu: bool = True, multiple: int | None = None) -> dict:
    """LoongSFTTrainer with "all-linear" LoRA (the tower's adapters included), 4 steps in ``layout`` saving at step 2,
    then a new run in ``resume_layout`` resumed from that checkpoint: the logged losses of both, the checkpoint's
    files (batches padded to a ``multiple`` of tokens when given, as sequence parallelism needs)."""
    import os

    import datasets
    import peft
    import trl
    from transformers import AutoTokenizer

    import loongforge_hf as lf
    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_vl import processor_for

    tok = AutoTokenizer.from_pretrained(folder)
    rows = datasets.Dataset.from_list([{k: v.tolist() for k, v in f.items()} for f in train_features(folder)] * 2)

    def run(resume: str | None, layout: dict) -> list[float]:
        args = trl.SFTConfig(**{**vl_training_args(out_dir).to_dict(), "hub_token": None, "learning_rate": 2e-2,
                                "max_steps": 4, "save_strategy": "steps", "save_steps": 2, "use_cpu": use_cpu,
                                "dataset_kwargs": {"skip_prepare_dataset": True}})
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
        trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                                     data_collator=DataCollatorForImageText.from_processor(
                                         processor_for(folder), pad_to_multiple_of=multiple),
                                     peft_config=peft.LoraConfig(**SFT_LORA))
        trainer.train(resume_from_checkpoint=resume)
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    full = run(None, layout)
    checkpoint = f"{out_dir}/checkpoint-2"
    return {"full": full, "resumed": run(checkpoint, resume_layout), "files": sorted(os.listdir(checkpoint))}


def peft_dora_checks(folder: str, out_dir: str, layout: dict) -> dict:
    """A PEFT-written DoRA adapter on every linear (the tower's too), every factor and magnitude moved off its initial
    value (so the rescaling is not 1), loaded here and in PEFT: logits, loss, the tower adapters' gradients (A, B,
    magnitude), the merged model's logits (differences); and refused on a split tower, nothing changed."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import LoraConfigError, load_adapter
    from loongforge_hf.lora.vision import chunk_params

    batch = make_batch(folder)
    adapter = f"{out_dir}/peft-dora"
    if dist.get_rank() == 0:
        hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        transformers.set_seed(1)
        model = peft.get_peft_model(hf, peft.LoraConfig(**CONFIGS["all_linear_dora"]))
        g = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
        save_naming_base(model, adapter, folder)
    dist.barrier()
    ref = peft.PeftModel.from_pretrained(
        transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32), adapter,
        is_trainable=True)
    model = load_adapter(lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout),
                         adapter, is_trainable=True)
    ours, theirs = model(**batch), ref(**batch)
    with torch.no_grad(), ref.disable_adapter():
        out = {"adapter_effect": float((theirs.logits - ref(**batch).logits).abs().max())}
    out.update(logits_diff=float((ours.logits - theirs.logits).abs().max()),
               loss_diff=float((ours.loss - theirs.loss).abs()))
    ours.loss.backward()
    theirs.loss.backward()
    params, theirs_params = chunk_params(model.chunks[0]), dict(ref.named_parameters())
    worst, compared = 0.0, 0
    for t in model.lora_plan.targets:
        if t.kind != "vision":
            continue
        for ours_name, peft_name in (("A", "lora_A.default.weight"), ("B", "lora_B.default.weight"),
                                     ("magnitude", "lora_magnitude_vector.default.weight")):
            got = params[f"{t.megatron_module}.lora.{t.name}.{ours_name}"].grad
            want = theirs_params[f"base_model.model.{t.hf_module}.{peft_name}"].grad
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
            compared += 1
    out.update(tower_grads_compared=compared, tower_grad_rel_diff=worst)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(**batch).logits
        out["merged_diff"] = float((model.merge_and_unload()(**batch).logits - logits).abs().max())
    try:
        split = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **SPLIT_TOWER)
        load_adapter(split, adapter)
        out["split_tower"] = "not refused"
    except LoraConfigError as err:
        out["split_tower"] = str(err)
        out["split_tower_untouched"] = type(split).__name__ == "LoongModelForImageTextToText" and not any(
            "lora" in n for n, _ in split.named_parameters())
    return out


# Qwen3-VL (test_qwen3_vl_lora.py): its tower's targets by name (ViT attention ``qkv`` / ``attn.proj``, MLP
# ``linear_fc1`` / ``linear_fc2``, which also name the patch merger's and DeepStack mergers' linears) with the language
# model's q/v (rsLoRA), "all-linear" and its DoRA (scaling 1, see all_linear), DoRA on the language model's attention
QWEN3_CONFIGS = {
    "tower_named": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "qkv", "attn.proj", "linear_fc1",
                                                           "linear_fc2"], init_lora_weights=False, use_rslora=True),
    "all_linear": CONFIGS["all_linear"],
    "all_linear_dora": CONFIGS["all_linear_dora"],
    "language_dora": CONFIGS["language_dora"],
}
QWEN3_SPLIT_SP = {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2, "sequence_parallel": True}
QWEN3_CASES = {  # layout -> (its arguments, the configs checked there); DoRA on a split tower is refused
    "tp1": ({}, ("tower_named", "all_linear", "all_linear_dora")),
    "tp2_split_sp": (QWEN3_SPLIT_SP, ("tower_named", "all_linear", "language_dora")),
    "pp2": ({"pipeline_parallel_size": 2}, ("tower_named", "all_linear", "all_linear_dora")),
    "cp2": ({"context_parallel_size": 2}, ("tower_named", "all_linear", "all_linear_dora")),
    # each TP rank encodes a share of the images (DeepStack's features with them)
    "tp2_encoder_dp": ({"tensor_parallel_size": 2, "vision_data_parallel": True},
                       ("tower_named", "all_linear", "all_linear_dora")),
}


def qwen3_checks(folder: str, out_dir: str, ranks: int) -> dict:
    """``model_checks`` of QWEN3_CASES' layouts for a world of ``ranks`` (1: tp1; 2: the others); then on one rank the
    refusals and SFT against TRL, on two a PEFT-written adapter loaded with the tower split and a PEFT-written DoRA
    adapter with the tower whole (refused split)."""
    out = {f"{layout_name}/{name}": model_checks(folder, f"{out_dir}/{layout_name}-{name}", layout, name,
                                                 QWEN3_CONFIGS)
           for layout_name, (layout, names) in QWEN3_CASES.items()
           if (layout_name == "tp1") == (ranks == 1) for name in names}
    if ranks == 1:
        out["refused"] = refusals(folder, tower_module="merger.norm")
        out["sft"] = {"trl": sft_losses(folder, out_dir + "/trl", loong=False),
                      "loong": sft_losses(folder, out_dir + "/loong", loong=True)}
        out["generate"] = generate_matches(folder)
    else:
        # NOTE: scaling 1, as all_linear says why: PEFT's fp32 logits (transformers' model) are off its float64 ones by
        # 2.6e-5 at PEFT's default lora_alpha 8 (scaling 4), 4.0e-6 at scaling 1; ours by 1.3e-6 and 5e-7 (TP1)
        out["peft_adapter"] = peft_adapter_checks(folder, out_dir, QWEN3_SPLIT_SP, multiple=4, lora_alpha=2,
                                                  saved=("lm_head", "language_model.norm"))
        out["peft_dora"] = peft_dora_checks(folder, out_dir, {"tensor_parallel_size": 2})
        out["resume"] = resume_matches_uninterrupted(folder, f"{out_dir}/resume", QWEN3_SPLIT_SP,
                                                     {"pipeline_parallel_size": 2}, multiple=4)
    return out
