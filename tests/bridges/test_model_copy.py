"""``copy.deepcopy(model)`` as transformers users do it (a reference model for preference training, an EMA copy):
the copy has its own parameters (changing them leaves the original alone), gives the same logits, exports the same
HF checkpoint and trains on its own; the process groups megatron's modules hold are shared, not copied (copying one
raised ``cannot pickle ... ProcessGroup``). A dense and a MoE model on one CPU process, tensor parallel 2 (logits
compared on every rank), and a LoRA model, whose copy keeps its class and adapters. A model held by a training
engine (megatron's DDP hooks and buffers on its parameters) is refused with a message until the engine releases it.
fp32: exact equality where nothing changed."""

import copy

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _copy_world(folder: str, out_dir: str, tp: int) -> dict:
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=tp)
    ids = torch.randint(4, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        same = torch.equal(twin(input_ids=ids).logits, want)
    mine, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    out = {"same_logits": same, "type": type(twin).__name__, "names_equal": mine.keys() == theirs.keys(),
           "shared_storage": any(p.data_ptr() == theirs[n].data_ptr() for n, p in mine.items()),
           "groups_shared": twin.chunks[0].decoder.layers[0].self_attention.linear_qkv.tp_group
           is model.chunks[0].decoder.layers[0].self_attention.linear_qkv.tp_group}
    if tp == 1:
        twin.save_pretrained(f"{out_dir}/twin")
        model.save_pretrained(f"{out_dir}/original")
        twin.train()
        twin(input_ids=ids, labels=ids).loss.backward()
        out["grads_on_copy_only"] = (all(p.grad is not None for p in theirs.values())
                                     and all(p.grad is None for p in mine.values()))
        with torch.no_grad():
            for p in theirs.values():
                p.add_(1.0)
            out["original_unchanged"] = torch.equal(model(input_ids=ids).logits, want)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_deepcopy_of_a_model(tmp_path, arch):
    from safetensors.torch import load_file

    folder = make_tiny_checkpoint(tmp_path / arch, arch, tokenizer=False)
    [got] = run_distributed(_copy_world, 1, str(folder), str(tmp_path / "out"), 1, timeout=300)
    assert got["same_logits"] and got["names_equal"] and got["groups_shared"], got
    assert got["type"] == "LoongModelForCausalLM" and not got["shared_storage"], got
    assert got["grads_on_copy_only"] and got["original_unchanged"], got
    twin = load_file(str(tmp_path / "out" / "twin" / "model.safetensors"))
    original = load_file(str(tmp_path / "out" / "original" / "model.safetensors"))
    assert twin.keys() == original.keys() and all(torch.equal(twin[k], original[k]) for k in twin)


def test_deepcopy_under_tensor_parallel(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", tokenizer=False)
    got = run_distributed(_copy_world, 2, str(folder), str(tmp_path / "out"), 2, timeout=300)
    for rank in got:
        assert rank["same_logits"] and rank["groups_shared"] and not rank["shared_storage"], rank


def _lora_copy_world(folder: str) -> dict:
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    model = get_peft_model(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           peft.LoraConfig(target_modules="all-linear", r=4, init_lora_weights=False))
    ids = torch.randint(4, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        same = torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    return {"same_logits": same, "type": type(twin).__name__,
            "trainable": twin.get_nb_trainable_parameters() == model.get_nb_trainable_parameters(),
            "config": twin.lora_config == model.lora_config and twin.lora_config is not model.lora_config}


def test_deepcopy_of_a_lora_model(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    [got] = run_distributed(_lora_copy_world, 1, str(folder), timeout=300)
    assert got == {"same_logits": True, "type": "LoongLoraModelForCausalLM", "trainable": True, "config": True}, got


def _engine_copy_world(folder: str, out_dir: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine = MegatronEngine(model, args=transformers.TrainingArguments(out_dir, use_cpu=True, report_to=[]))
    ids = torch.randint(4, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    engine.train_step([{"input_ids": ids, "labels": ids}])
    out = {}
    try:
        copy.deepcopy(model)
    except TypeError as err:
        out["held"] = str(err)
    engine.release()
    model.eval()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        out["released_same_logits"] = torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    return out


def test_deepcopy_of_a_model_held_by_an_engine(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    [got] = run_distributed(_engine_copy_world, 1, str(folder), str(tmp_path / "out"), timeout=300)
    assert "held by a training engine" in got.get("held", "") and "release" in got["held"], got
    assert got["released_same_logits"], got
