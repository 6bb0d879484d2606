"""Run inside each rank: load a tiny Qwen2.5-VL with loongforge-hf, compare with transformers, export."""

import numpy as np
import torch

# (text, image sizes in pixels (h, w)) per sample; 56x84 spans several attention windows
SAMPLES = [
    ("tok5 tok6 <|vision_start|><|image_pad|><|vision_end|> tok7 tok8 tok9", [(56, 84)]),
    ("<|vision_start|><|image_pad|><|vision_end|> tok10 tok11 <|vision_start|><|image_pad|><|vision_end|> tok12",
     [(28, 56), (56, 56)]),
    ("tok20 tok21 tok22 tok23", []),
]
# one image: under encoder data parallel over two ranks, one rank encodes nothing
ONE_IMAGE = [("tok5 <|vision_start|><|image_pad|><|vision_end|> tok6", [(28, 56)]), ("tok7 tok8 tok9", [])]
SAMPLE_SETS = {"default": SAMPLES, "one_image": ONE_IMAGE}
# the two-rank layouts of the image-text parity tests: name -> from_pretrained keywords
TWO_RANKS = {
    "tp2_sp_vision_tp2": {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2},
    "tp2_encoder_data_parallel": {"tensor_parallel_size": 2, "vision_data_parallel": True, "vision_recompute": True,
                                  "language_recompute": True},
    "pp2": {"pipeline_parallel_size": 2},
    "cp2": {"context_parallel_size": 2},
}


def make_batch(folder: str, samples=SAMPLES, seed: int = 3, **collator_kwargs) -> dict:
    """Each sample through the real processor, then the collator (``collator_kwargs``: e.g. pad_to_multiple_of)."""
    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_vl import processor_for

    processor = processor_for(folder)
    rng = np.random.RandomState(seed)
    features = []
    for text, sizes in samples:
        images = [rng.randint(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
        features.append(dict(processor(text=[text], images=images or None, return_tensors="pt")))
    return DataCollatorForImageText.from_processor(processor, **collator_kwargs)(features)


def hf_reference(folder: str, batch: dict):
    import transformers

    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    out = ref(**batch)
    out.loss.backward()
    grads = {n[len("model.visual."):]: p.grad for n, p in ref.named_parameters() if n.startswith("model.visual.")}
    return out.logits.detach(), out.loss.detach(), grads


def vision_grads(model, rename=None) -> dict:
    """HF name (after ``visual.``, or ``rename(name)``) -> full gradient of every vision parameter (TP shards
    gathered), first stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    bridge, tower = model.bridge, model.vision_tower
    split = model.vision_layout == "tensor_parallel"
    group = ps.get_tensor_model_parallel_group()
    ctx = bridge.vision_shard_context(tp_rank=ps.get_tensor_model_parallel_rank() if split else 0,
                                      tp_size=dist.get_world_size(group) if split else 1)
    params = dict(tower.named_parameters())
    out = {}
    for name, (mapping, layer) in bridge.vision_mapping_table().items():
        grad = params[name].grad
        if grad is None:  # NOTE: a tensor the features never pass through (LLaVA's ViT blocks after its feature layer)
            continue
        shards = [grad]
        if split and mapping.tp_split is not None:
            shards = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, grad.contiguous(), group=group)
        out.update({rename(n) if rename else n.split("visual.", 1)[1]: g
                    for n, g in mapping.export(shards, ctx, layer).items()})
    return out


_REFERENCE: dict = {}


def reference(folder: str, samples: str, multiple: int | None = None):
    """(batch, transformers' logits, loss, vision grads) for ``folder`` and a sample set (padded to a ``multiple`` of
    tokens when given), computed once per process."""
    if (folder, samples, multiple) not in _REFERENCE:
        batch = make_batch(folder, SAMPLE_SETS[samples], pad_to_multiple_of=multiple)
        _REFERENCE[folder, samples, multiple] = (batch, *hf_reference(folder, batch))
    return _REFERENCE[folder, samples, multiple]


def compare_and_export(folder: str, layout: dict, out_dir: str, samples: str = "default",
                       multiple: int | None = None) -> dict:
    import loongforge_hf as lf

    batch, ref_logits, ref_loss, ref_grads = reference(folder, samples, multiple)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = model(**batch)
    valid = batch["attention_mask"].bool()
    result = {"logit_diff": (out.logits - ref_logits).abs()[valid].max().item(),
              "loss_diff": abs(out.loss.item() - ref_loss.item()), "logits_shape": tuple(out.logits.shape),
              "grad_diff": None, "vision_layout": model.vision_layout, "batch_shape": tuple(batch["input_ids"].shape)}
    if layout.get("pipeline_parallel_size", 1) == 1:
        out.loss.backward()
        grads = vision_grads(model)
        if layout.get("context_parallel_size", 1) > 1:  # NOTE: each CP rank's gradient is its share's
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            for g in grads.values():
                dist.all_reduce(g, group=ps.get_context_parallel_group())
        assert sorted(grads) == sorted(ref_grads), sorted(set(grads) ^ set(ref_grads))
        result["grad_diff"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    model.save_pretrained(out_dir, max_shard_size="60KB")
    return result


def compare_many(cases: list, frozen: tuple | None = None) -> dict:
    """``compare_and_export`` for several (name, folder, layout, out_dir) in one world (groups rebuilt for each),
    then ``freeze_and_step(*frozen)`` under "frozen" when given (one process start for all)."""
    out = {name: compare_and_export(folder, layout, out_dir, *rest) for name, folder, layout, out_dir, *rest in cases}
    if frozen is not None:
        out["frozen"] = freeze_and_step(*frozen)
    return out


def freeze_and_step(folder: str, layout: dict) -> dict:
    """Load with the vision tower and the language model frozen, take one torch AdamW step over what is trainable,
    and build LoongTrainer's megatron optimizer: report which parameters moved and which the optimizer holds."""
    from types import SimpleNamespace

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    batch = make_batch(folder)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, freeze_vision=True,
                                                           freeze_language=True, **layout)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model(**batch).loss.backward()
    got_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    optimizer.step()
    moved = sorted(n for n, p in model.named_parameters() if not torch.equal(p, before[n]))
    args = SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           max_grad_norm=1.0)
    engine = MegatronEngine(model, args=args)
    held = sum(p.numel() for opt in engine.inner_optimizers() for g in opt.param_groups for p in g["params"])
    return {"trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad), "moved": moved,
            "got_grad": got_grad, "optimizer_numel": held,
            "trainable_numel": sum(p.numel() for p in trainable)}


# ---- training through LoongTrainer against transformers.Trainer ------------------------------------------------------

TRAIN_SAMPLES = [(f"tok{5 + i} <|vision_start|><|image_pad|><|vision_end|> tok{30 + i} tok{40 + i}", [(28, 56)])
                 for i in range(4)] + [(f"tok{60 + i} tok{70 + i} tok{80 + i}", []) for i in range(4)]


def train_features(folder: str) -> list:
    from loongforge_hf.testing.tiny_vl import processor_for

    processor = processor_for(folder)
    rng = np.random.RandomState(5)
    return [dict(processor(text=[text], images=[rng.randint(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
                           or None, return_tensors="pt")) for text, sizes in TRAIN_SAMPLES]


def vl_training_args(out_dir: str):
    import transformers

    return transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=3,
        learning_rate=5e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        seed=0, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, remove_unused_columns=False)


def train_both(folder: str, out_dir: str) -> dict:
    """transformers.Trainer, then LoongTrainer (TP1), in one process: logged losses of each."""
    hf = train_vl(folder, out_dir + "/hf", loong=False)
    return {"hf": hf, "loong": train_vl(folder, out_dir + "/loong", loong=True)}


def train_vl(folder: str, out_dir: str, *, loong: bool, layout: dict | None = None) -> list:
    """Train 3 steps with the vision tower (not the projector) frozen; return the logged losses."""
    from loongforge_hf.testing.tiny_vl import processor_for

    def freeze(model):
        for name, p in model.model.visual.named_parameters():  # NOTE: the projector trains (DeepStack's too)
            p.requires_grad_(name.startswith(("merger.", "deepstack_merger_list.")))

    return trained_losses(folder, out_dir, loong=loong, processor=processor_for(folder),
                          features=train_features(folder), freeze=freeze, layout=layout)


def collated_logits(folder: str, processor, features: list) -> tuple[dict, dict, dict]:
    """``features`` collated by ``processor``'s collator padded and packed (one row, 2-D positions restarting per
    sample): (padded batch, packed batch, {shapes, "packed_diff": packed against padded at every real token,
    "padded_diff": ours against transformers' on the padded batch})."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText

    padded = DataCollatorForImageText.from_processor(processor)(features)
    packed = DataCollatorForImageText.from_processor(processor, packing=True)(features)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        got_padded, got_packed, want = model(**padded).logits, model(**packed).logits, ref(**padded).logits
    valid = padded["attention_mask"].bool()
    return padded, packed, {"packed_shape": tuple(packed["input_ids"].shape),
                            "positions": tuple(packed["position_ids"].shape),
                            "packed_diff": (got_packed[0] - got_padded[valid]).abs().max().item(),
                            "padded_diff": (got_padded - want).abs()[valid].max().item()}


def frozen(tower: str):
    """``trained_losses``' ``freeze`` for transformers' image-text models whose tower is ``model.model.<tower>``."""
    return lambda model: getattr(model.model, tower).requires_grad_(False)


def trained_losses(folder: str, out_dir: str, *, loong: bool, processor, features: list, freeze=None,
                   layout: dict | None = None) -> list:
    """Three steps of batches of 2 of ``features`` (``vl_training_args``) through ``processor``'s collator, with
    LoongTrainer (``loong``; ``freeze_vision`` when ``freeze`` is given, in ``layout``) or transformers.Trainer (the
    tensors ``freeze(model)`` freezes): the logged losses; the model saved under ``out_dir/final``."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText

    collator = DataCollatorForImageText.from_processor(processor)
    args = vl_training_args(out_dir)
    if loong:
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                               freeze_vision=freeze is not None, **(layout or {}))
        trainer = lf.LoongTrainer(model=model, args=args, train_dataset=features, data_collator=collator)
    else:
        torch.manual_seed(0)
        model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        if freeze is not None:
            freeze(model)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=features, data_collator=collator)
    trainer.train()
    trainer.save_model(out_dir + "/final")
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def check_generate(per_layout: dict, tol: float = 1e-4) -> None:
    """Each layout's generate scenarios (``_vl_gemma3.generate_pair``'s results): transformers' sequences, logits /
    scores within ``tol``, at least 4 steps."""
    for layout, scenarios in per_layout.items():
        for name, r in scenarios.items():
            assert r["same_sequences"] and r["max_diff"] < tol and r["steps"] >= 4, (layout, name, r)


def check_llava_two_ranks(per_rank: list, out, folders: dict, *, check, grads: dict, side_files) -> None:
    """test_llava / test_llava_next's two-rank world: each layout of ``TWO_RANKS`` and the Qwen2 variant split under
    SP as transformers (``check``; vision gradients ``grads[variant]`` counted but under PP), generate, the towers'
    layouts as asked, each layout exported bit for bit."""
    from loongforge_hf.testing.round_trip import check_round_trip

    for got in per_rank:
        results = got["parity"]
        for n, layout in TWO_RANKS.items():
            check(results[n], grads=grads["llama"] if layout.get("pipeline_parallel_size", 1) == 1 else None)
        check(results["qwen2_split_sp"], grads=grads["qwen2"])
        check_generate(got["generate"])
    parity = per_rank[0]["parity"]
    assert parity["tp2_sp_vision_tp2"]["vision_layout"] == parity["qwen2_split_sp"]["vision_layout"] \
        == "tensor_parallel"
    assert parity["tp2_encoder_data_parallel"]["vision_layout"] == "data_parallel"
    for n in TWO_RANKS:
        check_round_trip(folders["llama"], out / n, side_files=side_files)
    check_round_trip(folders["qwen2"], out / "qwen2_split_sp", side_files=side_files)


def check_lora_vs_peft(per_rank: list, names_by_case: dict, *, targets: dict, saved: dict,
                       idle: dict | None = None, params: dict | None = None, no_grads: tuple = ()) -> None:
    """The LoRA-vs-PEFT results (``r["lora"]["{case}/{name}"]`` of each rank's dict) for each case's adapter config
    names: PEFT's trainable counts, logits / loss within 1e-5, our model unchanged by the merged export, the adapters
    whose gradients were checked (vision, language and, with ``idle``, those PEFT gives none: ``targets[name]``,
    ``idle[name]``); on rank 0 the saved adapter's logits in PEFT (1e-5), the merged export's in transformers (3e-5),
    ``target_modules`` as PEFT's and the file's tensor count (two per adapter plus ``saved[name]`` whole tensors);
    with ``params``, the number of PEFT ``target_parameters`` adapters (expert stacks, routers) whose gradients were
    checked (``params[name]``, 0 where absent); the cases in ``no_grads`` (pipeline stages: ``model_checks`` checks
    gradients on one stage) without gradients checked."""
    for case, names in names_by_case.items():
        for name in names:
            want = (*targets[name], idle[name]) if idle else tuple(targets[name])
            for res in (r["lora"][f"{case}/{name}"] for r in per_rank):
                assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
                assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
                assert res["unchanged_after_merged_export"]
                if case in no_grads:
                    assert "grads_checked" not in res, (case, name, res)
                    continue
                checked = res["grads_checked"]
                got = (checked["vision"], checked["language"]) + ((checked["idle"],) if idle else ())
                assert got == want, (case, name, res)
                if params is not None:
                    assert checked.get("params", 0) == 2 * params.get(name, 0), (case, name, res)
            rank0 = per_rank[0]["lora"][f"{case}/{name}"]
            assert rank0["adapter_logits_diff"] < 1e-5 and rank0["merged_logits_diff"] < 3e-5, rank0
            ours, theirs = rank0["target_modules"]
            assert sorted(ours) == sorted(theirs), (ours, theirs)
            tensors = 2 * (sum(want) + (params or {}).get(name, 0)) + saved[name]
            assert rank0["adapter_tensors"] == (tensors, True), rank0["adapter_tensors"]
