"""PEFT adapter folders, written by ``PeftModel.save_pretrained`` on the transformers model, loaded onto loongforge
models: ``lf.AutoModelForCausalLM.from_pretrained(adapter_dir)`` (the base model it names, then the adapter, frozen,
as transformers does) and ``loongforge_hf.lora.load_adapter(model, dir, is_trainable=True)``. At TP1, TP2 and PP2:
logits within 1e-4 and loss within 1e-5 of ``PeftModel.from_pretrained`` (fp32, as test_lora.py), PEFT's parameter
counts, the adapter saved again equal to the file loaded (bit for bit); a folder missing a tensor, a pickle adapter
without ``allow_pickle`` and a non-LoRA adapter refused on every rank with messages naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .._hub_cache import folder_in_hub_cache
from ._lora_load import load_checks, two_rank_checks, write_peft_adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    base = tmp_path_factory.mktemp("lora-load")
    folder = str(make_tiny_checkpoint(base / "llama", "llama"))
    adapter = str(base / "adapter")
    write_peft_adapter(folder, adapter)
    bad = {}
    missing = base / "missing"
    shutil.copytree(adapter, missing)
    tensors = load_file(str(missing / "adapter_model.safetensors"))
    tensors.pop("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
    save_file(tensors, str(missing / "adapter_model.safetensors"))
    bad["missing"] = str(missing)
    pickled = base / "pickled"
    shutil.copytree(adapter, pickled)
    torch.save(load_file(str(pickled / "adapter_model.safetensors")), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    bad["pickled"] = str(pickled)
    other = base / "ia3"
    shutil.copytree(adapter, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    bad["ia3"] = str(other)
    return folder, adapter, bad, base


@pytest.fixture(scope="module")
def results(setup):
    folder, adapter, bad, base = setup
    folder_in_hub_cache(Path(adapter), base / "hub", "tiny-org/tiny-adapter")
    one = run_distributed(load_checks, 1, folder, adapter, bad, str(base / "tp1"), {},
                          (str(base / "hub"), "tiny-org/tiny-adapter"), timeout=400)
    two = run_distributed(two_rank_checks, 2, folder, adapter, bad, str(base / "two"), timeout=600)
    return {"tp1": one, "tp2": [r["tp2"] for r in two], "pp2": [r["pp2"] for r in two]}


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_adapter_folder_loads_like_peft(results, layout):
    for rank in results[layout]:
        frozen, trainable = rank["frozen"], rank["trainable"]
        assert frozen["class"] == "LoongLoraModelForCausalLM" and frozen["trainable"] == 0
        assert frozen["logits_diff"] < 1e-4 and frozen["loss_diff"] < 1e-5, frozen
        assert tuple(trainable["counts"]) == tuple(trainable["peft"])
    assert results[layout][0]["trainable"]["same_tensors"]


def test_adapter_hub_id_loads_from_the_cache(setup, results):
    """An adapter's hub id resolves through the HF cache (offline here), as transformers resolves one."""
    hub = results["tp1"][0]["hub"]
    assert hub["class"] == "LoongLoraModelForCausalLM" and hub["logits_diff"] < 1e-4, hub
    assert hub["base_model"] == setup[0]


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_bad_adapter_folders_fail_alike_on_every_rank(results, layout):
    ranks = results[layout]
    for name, fragments in {"missing": ["CheckpointError", "layers.1.mlp.down_proj.lora_B.weight", "missing"],
                            "pickled": ["CheckpointError", "allow_pickle=True", "adapter_model.bin"],
                            "ia3": ["LoraConfigError", "'IA3'"]}.items():
        message = ranks[0]["errors"][name]
        assert message is not None and all(f in message for f in fragments), (name, message)
        assert all(r["errors"][name] == message for r in ranks)
