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


def make_batch(folder: str, samples=SAMPLES, seed: int = 3) -> dict:
    """Each sample through the real processor, then the collator."""
    from transformers import AutoTokenizer

    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_vl import make_processor

    processor = make_processor(AutoTokenizer.from_pretrained(folder))
    rng = np.random.RandomState(seed)
    features = []
    for text, sizes in samples:
        images = [rng.randint(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
        features.append(dict(processor(text=[text], images=images or None, return_tensors="pt")))
    return DataCollatorForImageText.from_processor(processor)(features)


def hf_reference(folder: str, batch: dict):
    import transformers

    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    out = ref(**batch)
    out.loss.backward()
    grads = {n[len("model.visual."):]: p.grad for n, p in ref.named_parameters() if n.startswith("model.visual.")}
    return out.logits.detach(), out.loss.detach(), grads


def vision_grads(model) -> dict:
    """Name after ``visual.`` -> full gradient of every vision parameter (TP shards gathered), first stage."""
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
        shards = [grad]
        if split and mapping.tp_split is not None:
            shards = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, grad.contiguous(), group=group)
        out.update({n.split("visual.", 1)[1]: g for n, g in mapping.export(shards, ctx, layer).items()})
    return out


_REFERENCE: dict = {}


def reference(folder: str):
    """(batch, transformers' logits, loss, vision grads) for ``folder``, computed once per process."""
    if folder not in _REFERENCE:
        batch = make_batch(folder)
        _REFERENCE[folder] = (batch, *hf_reference(folder, batch))
    return _REFERENCE[folder]


def compare_and_export(folder: str, layout: dict, out_dir: str) -> dict:
    import loongforge_hf as lf

    batch, ref_logits, ref_loss, ref_grads = reference(folder)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = model(**batch)
    valid = batch["attention_mask"].bool()
    result = {"logit_diff": (out.logits - ref_logits).abs()[valid].max().item(),
              "loss_diff": abs(out.loss.item() - ref_loss.item()), "logits_shape": tuple(out.logits.shape),
              "grad_diff": None, "vision_layout": model.vision_layout}
    if layout.get("pipeline_parallel_size", 1) == 1:
        out.loss.backward()
        grads = vision_grads(model)
        assert sorted(grads) == sorted(ref_grads), sorted(set(grads) ^ set(ref_grads))
        result["grad_diff"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    model.save_pretrained(out_dir, max_shard_size="60KB")
    return result


def compare_many(cases: list) -> dict:
    """``compare_and_export`` for several (name, folder, layout, out_dir) in one world (groups rebuilt for each)."""
    return {name: compare_and_export(folder, layout, out_dir) for name, folder, layout, out_dir in cases}


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
