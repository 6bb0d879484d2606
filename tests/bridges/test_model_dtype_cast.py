"""``model.to(torch.bfloat16)`` on a model loaded in fp32, as transformers users cast: megatron's configs follow the
parameters (``model.dtype``, what ``save_pretrained`` writes, pipeline receive buffers), so the cast model equals a
model loaded in bf16: the same logits / loss (exact: the same bf16 weights and the same ops), the same exported
tensors and config dtype, and under pipeline parallelism 2 (CPU, gloo) the same loss on every rank. A model held by
a training engine refuses the cast with a message (its gradient buffers and optimizer keep the old dtype)."""

import json

import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _cast_world(folder: str, out_dir: str, pp: int) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    cast = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                   pipeline_parallel_size=pp).to(torch.bfloat16)
    loaded = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, pipeline_parallel_size=pp)
    ids = torch.randint(4, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = cast(input_ids=ids, labels=ids), loaded(input_ids=ids, labels=ids)
    out = {"dtype": str(cast.dtype), "loss_equal": a.loss.item() == b.loss.item()}
    if pp == 1:
        out["logits_equal"] = torch.equal(a.logits, b.logits)
        cast.save_pretrained(f"{out_dir}/cast")
        loaded.save_pretrained(f"{out_dir}/loaded")
        engine = MegatronEngine(loaded, args=transformers.TrainingArguments(out_dir, use_cpu=True, report_to=[]))
        engine.train_step([{"input_ids": ids, "labels": ids}])
        try:
            loaded.float()
        except TypeError as err:
            out["held"] = str(err)
        out["held_dtype"] = str(next(loaded.parameters()).dtype)
    return out


def test_cast_to_bf16_equals_a_bf16_load(tmp_path):
    from safetensors.torch import load_file

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    [got] = run_distributed(_cast_world, 1, str(folder), str(tmp_path / "out"), 1, timeout=300)
    assert got["dtype"] == "torch.bfloat16" and got["loss_equal"] and got["logits_equal"], got
    assert "training engine" in got["held"] and got["held_dtype"] == "torch.bfloat16", got
    cast = load_file(str(tmp_path / "out" / "cast" / "model.safetensors"))
    loaded = load_file(str(tmp_path / "out" / "loaded" / "model.safetensors"))
    assert cast.keys() == loaded.keys() and all(
        cast[k].dtype == torch.bfloat16 and torch.equal(cast[k], loaded[k]) for k in cast)
    config = json.loads((tmp_path / "out" / "cast" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16", config


def test_cast_under_pipeline_parallel(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False, num_hidden_layers=4)
    got = run_distributed(_cast_world, 2, str(folder), str(tmp_path / "out"), 2, timeout=300)
    for rank in got:
        assert rank["dtype"] == "torch.bfloat16" and rank["loss_equal"], got
