"""Rank functions for test_lora_load.py: PEFT adapter folders (written by PEFT itself) loaded onto loongforge models."""

from __future__ import annotations

import torch

LORA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
               modules_to_save=["post_attention_layernorm", "lm_head"])


def write_peft_adapter(folder: str, out_dir: str, lora_kw: dict = LORA_KW) -> None:
    """A PEFT adapter (``lora_kw``) of the transformers model with every factor (B included) and the modules_to_save
    tensors random, saved by ``PeftModel.save_pretrained``."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(7)
    model = peft.get_peft_model(hf, peft.LoraConfig(**lora_kw))
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out_dir)


def _probe() -> torch.Tensor:
    return torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(3))


def load_checks(folder: str, adapter_dir: str, bad_dirs: dict, out_dir: str, layout: dict,
                hub: tuple[str, str] | None = None) -> dict:
    import peft
    import torch.distributed as dist
    import transformers
    from safetensors.torch import load_file

    import loongforge_hf as lf
    from loongforge_hf.lora import LoongLoraModelForCausalLM, load_adapter

    ids = _probe()
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                                           dtype=torch.float32),
                                         adapter_dir)
    with torch.no_grad():
        expected = ref(input_ids=ids, labels=ids)
    out = {}
    # the adapter folder itself, as transformers loads one: its base model, then the adapter, frozen
    model = lf.AutoModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32, **layout)
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids)
    out["frozen"] = {"class": type(model).__name__, "trainable": sum(p.requires_grad for p in model.parameters()),
                     "logits_diff": float((got.logits - expected.logits).abs().max()),
                     "loss_diff": float((got.loss - expected.loss).abs())}
    # onto a loaded base model, trainable: PEFT's counts, and saved again it is the same adapter
    base = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    model = load_adapter(base, adapter_dir, is_trainable=True)
    assert isinstance(model, LoongLoraModelForCausalLM)
    model.save_pretrained(out_dir + "/again")
    trainable_ref = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), adapter_dir, is_trainable=True)
    out["trainable"] = {"counts": model.get_nb_trainable_parameters(),
                        "peft": trainable_ref.get_nb_trainable_parameters()}
    if dist.get_rank() == 0:
        before, after = load_file(adapter_dir + "/adapter_model.safetensors"), load_file(
            out_dir + "/again/adapter_model.safetensors")
        out["trainable"]["same_tensors"] = sorted(before) == sorted(after) and all(
            torch.equal(before[n], after[n]) for n in before)
    if hub is not None:
        # the adapter by hub id, from an offline HF cache holding it (hub = (cache folder, repo id))
        import os

        os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=hub[0])
        model = lf.AutoModelForCausalLM.from_pretrained(hub[1], dtype=torch.float32, **layout)
        with torch.no_grad():
            got = model(input_ids=ids, labels=ids)
        out["hub"] = {"class": type(model).__name__, "logits_diff": float((got.logits - expected.logits).abs().max()),
                      "base_model": model.lora_config.base_model_name_or_path}
    # bad folders: the same error on every rank
    out["errors"] = {}
    for name, bad in bad_dirs.items():
        try:
            lf.AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32, **layout)
            out["errors"][name] = None
        except Exception as err:  # noqa: BLE001 - the test reads the type and message
            out["errors"][name] = f"{type(err).__name__}: {err}"
    return out


def two_rank_checks(folder: str, adapter_dir: str, bad_dirs: dict, out_dir: str) -> dict:
    return {"tp2": load_checks(folder, adapter_dir, bad_dirs, out_dir + "/tp2", {"tensor_parallel_size": 2}),
            "pp2": load_checks(folder, adapter_dir, bad_dirs, out_dir + "/pp2", {"pipeline_parallel_size": 2})}
