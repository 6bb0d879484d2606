"""PEFT's ``disable_adapter()``, ``merge_and_unload()`` and ``unload()`` on a loongforge LoRA model, against PEFT on
the transformers model (same LoraConfig after the same seed, fp32, logits within 1e-4):

- inside ``disable_adapter()`` the logits are the base model's (and PEFT's inside its own), outside they are the
  adapted ones again; with trained ``modules_to_save`` too (their originals inside the block, as PEFT's original
  modules; ``unload()`` puts them back, ``merge_and_unload()`` keeps the trained ones, as PEFT);
- ``merge_and_unload()`` gives PEFT's merged logits and leaves a plain ``LoongModelForCausalLM`` (no adapter
  parameter, the same number of trainable parameters as PEFT's merged model), whose export loads in transformers
  with those logits; ``unload()`` gives the base model's logits;
- a Llama with q/v adapters and trainable token rows at TP1 and TP2, the same on a Qwen3 with tied embeddings at TP2
  (the LM head's rows trained too), and a Qwen3-MoE with every linear adapted (attention, experts, router) at TP1; a
  model held by a training engine refuses to merge.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

DENSE = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
             trainable_token_indices=[5, 9, 100])
MOE = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def _world(folder: str, out_dir: str, layout: dict, kw: dict) -> dict:
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model
    from loongforge_hf.trainer.engine import MegatronEngine

    from ._lora_checks import lora_pair

    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[0, :3] = torch.tensor([5, 9, 100])

    def diff(a, b):
        return float((a - b).abs().max())

    model, hf, ref = lora_pair(folder, layout, kw)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        base_logits, adapted = base(input_ids=ids).logits, ref(input_ids=ids).logits
        with model.disable_adapter(), ref.disable_adapter():
            out["disabled"] = (diff(model(input_ids=ids).logits, base_logits), diff(ref(input_ids=ids).logits,
                                                                                    base_logits))
        out["enabled_again"] = diff(model(input_ids=ids).logits, adapted)
        out["adapted_vs_base"] = diff(adapted, base_logits)
        merged = model.merge_and_unload()
        ref_merged = ref.merge_and_unload()
        out["merged"] = diff(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits)
    out["type"] = type(merged).__name__
    out["adapter_params"] = [n for n, _ in merged.named_parameters() if "lora" in n or "token_adapter" in n]
    out["trainable"] = (sum(p.requires_grad for p in merged.parameters()) if layout == {} else None,
                        sum(p.requires_grad for p in ref_merged.parameters()))
    merged.save_pretrained(f"{out_dir}/merged")
    with torch.no_grad():
        out["merged_logits"] = merged(input_ids=ids).logits
    out["ids"] = ids

    model, _, _ = lora_pair(folder, layout, kw)
    with torch.no_grad():
        out["unloaded"] = diff(model.unload()(input_ids=ids).logits, base_logits)

    model = get_peft_model(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
                           peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["norm"]))
    MegatronEngine(model, args=transformers.TrainingArguments(out_dir + "/engine", use_cpu=True, report_to=[]))
    try:
        model.merge_and_unload()
    except TypeError as err:
        out["held"] = str(err)
    return out


@pytest.mark.parametrize("arch, kw, layout", [
    ("llama", DENSE, {}), ("llama", DENSE, {"tensor_parallel_size": 2}), ("qwen3_moe", MOE, {}),
    ("qwen3-tied", DENSE, {"tensor_parallel_size": 2}),
], ids=["llama-tp1", "llama-tp2", "qwen3_moe-tp1", "qwen3-tied-tp2"])
def test_disable_merge_unload_match_peft(tmp_path, arch, kw, layout):
    import transformers

    folder = make_tiny_checkpoint(tmp_path / arch, arch.removesuffix("-tied"), tokenizer=False,
                                  tie_word_embeddings=arch.endswith("-tied"))
    ranks = layout.get("tensor_parallel_size", 1)
    got = run_distributed(_world, ranks, str(folder), str(tmp_path / "out"), layout, kw, timeout=400)[0]
    assert got["adapted_vs_base"] > 1e-2, got  # the adapters change the logits: the checks below mean something
    assert max(got["disabled"]) < 1e-4 and got["enabled_again"] < 1e-4, got
    assert got["merged"] < 1e-4 and got["unloaded"] < 1e-4, got
    assert got["type"] == "LoongModelForCausalLM" and got["adapter_params"] == [], got
    if layout == {}:
        assert got["trainable"][0] == got["trainable"][1], got
    assert "training engine" in got["held"], got
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=got["ids"]).logits, got["merged_logits"], atol=1e-4, rtol=0)


def _copy_world(folder: str) -> dict:
    import copy

    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    model = get_peft_model(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           peft.LoraConfig(**DENSE))
    ids = torch.tensor([[5, 9, 100, 7, 8]])
    with torch.no_grad():
        model.chunks[0].embedding.token_adapter.trainable_tokens_delta.add_(1.0)
        adapted = model(input_ids=ids).logits
        twin = copy.deepcopy(model)
        twin.unload()
        return {"original_kept": torch.equal(model(input_ids=ids).logits, adapted),
                "twin_unloaded": not torch.equal(twin(input_ids=ids).logits, adapted),
                "twin_type": type(twin).__name__, "original_type": type(model).__name__}


def test_unloading_a_copy_leaves_the_original(tmp_path):
    """``copy.deepcopy`` of a LoRA model with trainable tokens (a reference model), then ``unload()`` of the copy: the
    original keeps its adapters and trainable rows (the copy's hooks are its own)."""
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    [got] = run_distributed(_copy_world, 1, str(folder), timeout=300)
    assert got == {"original_kept": True, "twin_unloaded": True, "twin_type": "LoongModelForCausalLM",
                   "original_type": "LoongLoraModelForCausalLM"}, got


SAVED = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
             modules_to_save=["post_attention_layernorm", "norm", "lm_head"])


def _saved_world(folder: str, out_dir: str) -> dict:
    import copy

    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora.load import load_adapter

    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    transformers.set_seed(5)
    ref = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                              peft.LoraConfig(**SAVED))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # NOTE: "trained" modules_to_save copies
        for name, p in ref.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    ref.save_pretrained(f"{out_dir}/peft")
    model = load_adapter(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), f"{out_dir}/peft",
                         is_trainable=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def diff(a, b):
        return float((a - b).abs().max())

    out = {}
    with torch.no_grad():
        base_logits, adapted = base(input_ids=ids).logits, ref(input_ids=ids).logits
        out["adapted"] = diff(model(input_ids=ids).logits, adapted)
        with model.disable_adapter(), ref.disable_adapter():
            out["disabled"] = (diff(model(input_ids=ids).logits, base_logits),
                               diff(ref(input_ids=ids).logits, base_logits))
        out["enabled_again"] = diff(model(input_ids=ids).logits, adapted)
        out["unloaded"] = diff(copy.deepcopy(model).unload()(input_ids=ids).logits, base_logits)
        out["merged"] = diff(model.merge_and_unload()(input_ids=ids).logits,
                             ref.merge_and_unload()(input_ids=ids).logits)
        out["adapted_vs_base"] = diff(adapted, base_logits)
    return out


def test_modules_to_save_under_disable_unload_and_merge(tmp_path):
    """LoRA with trained norms and LM head (``modules_to_save``, a PEFT-written adapter loaded onto our model):
    ``disable_adapter()`` runs them with their original values and ``unload()`` restores those, as PEFT's original
    modules; ``merge_and_unload()`` keeps the trained ones, as PEFT (logits 1e-4)."""
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    [got] = run_distributed(_saved_world, 1, str(folder), str(tmp_path), timeout=300)
    assert got["adapted_vs_base"] > 1e-2, got
    assert got["adapted"] < 1e-4 and max(got["disabled"]) < 1e-4 and got["enabled_again"] < 1e-4, got
    assert got["unloaded"] < 1e-4 and got["merged"] < 1e-4, got
