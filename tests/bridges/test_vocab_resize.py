"""``resize_token_embeddings`` as transformers': the embedding and an untied LM head get the new rows in every layout
(TP2 moves rows between ranks as the padded size changes; PP2 with tied weights updates the last stage's copy).

Checks, against the real thing:
- the resized model's logits equal transformers' logits of the folder it exports (fp32, 1e-4: the usual parity), so
  forward, loss masking and export all use the new rows; the exported config has the new ``vocab_size``;
- the kept rows are the source's exactly; the added rows are those transformers' own resize draws after the same
  seed, bit for bit (mean resizing: a normal with the old rows' mean and 1e-9 x their covariance; and
  ``mean_resizing=False``), whichever rank holds what, so the logits equal transformers' resized model's (1e-4) and
  the loss too (1e-5 relative); shrinking keeps the first rows;
- refused with a message: bad sizes (on every rank, before any collective), a model held by a training engine, a
  LoRA model.
"""

import json

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

IDS = torch.tensor([[5, 6, 7, 205, 210, 11, 262, 12, 140, 3]])
SHRINK_IDS = torch.tensor([[5, 6, 7, 120, 149, 11, 100, 12]])


def _resize_world(folder: str, out_dir: str, layout: dict, cases: list) -> dict:
    import loongforge_hf as lf

    out = {}
    for name, new, multiple, ids in cases:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        torch.manual_seed(0)  # NOTE: as the reference below: the added rows are then transformers' own
        returned = model.resize_token_embeddings(new, pad_to_multiple_of=multiple)
        with torch.no_grad():
            result = model(input_ids=ids, labels=ids)
        model.save_pretrained(f"{out_dir}/{name}")
        out[name] = {"loss": result.loss.item(), "logits": result.logits, "vocab_size": model.vocab_size,
                     "returned": type(returned).__name__, "after": torch.rand(2)}  # NOTE: each generator moved alike
    return out


def _reference(folder, new: int, multiple, ids: torch.Tensor, mean_resizing: bool = True):
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.resize_token_embeddings(new, pad_to_multiple_of=multiple, mean_resizing=mean_resizing)
    with torch.no_grad():
        return hf, hf(input_ids=ids, labels=ids)


def _exported_logits(path, ids):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return hf, hf(input_ids=ids).logits


def _check(src, out, got: dict, new: int, multiple, ids: torch.Tensor) -> None:
    from safetensors.torch import load_file

    ref, ref_out = _reference(src, new, multiple, ids)
    size = ref.config.vocab_size
    assert got["vocab_size"] == size and json.loads((out / "config.json").read_text())["vocab_size"] == size
    exported, logits = _exported_logits(out, ids)
    assert got["logits"].shape == logits.shape == (1, ids.shape[1], size)
    torch.testing.assert_close(got["logits"], logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(got["logits"], ref_out.logits, atol=1e-4, rtol=0)
    assert got["loss"] == pytest.approx(ref_out.loss.item(), rel=1e-5)
    source = {}
    for f in src.glob("*.safetensors"):
        source.update(load_file(str(f)))
    heads = [("model.embed_tokens.weight", exported.get_input_embeddings(), ref.get_input_embeddings())]
    if not ref.config.tie_word_embeddings:
        heads.append(("lm_head.weight", exported.get_output_embeddings(), ref.get_output_embeddings()))
    old = source["model.embed_tokens.weight"].shape[0]
    for name, ours, theirs in heads:
        ours, theirs, kept = ours.weight.detach(), theirs.weight.detach(), min(old, size)
        assert torch.equal(ours[:kept], source[name][:kept]), name
        assert torch.equal(ours[kept:], theirs[kept:]), name  # the added rows: transformers' draws, bit for bit


@pytest.mark.parametrize("arch, tied, layout, ranks, cases", [
    ("llama", False, {}, 1, [("grow", 263, None, IDS), ("shrink", 150, None, SHRINK_IDS)]),
    ("qwen3", True, {"tensor_parallel_size": 2}, 2, [("grow", 300, 64, IDS)]),
    ("qwen3", True, {"pipeline_parallel_size": 2}, 2, [("grow", 263, None, IDS)]),
    ("qwen3", True, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}, 2, [("grow", 263, None, IDS)]),
    ("llama", False, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4, [("grow", 263, 64, IDS)]),
    ("llama", False, {}, 2, [("grow", 263, None, IDS)]),
], ids=["tp1", "tp2-tied", "pp2-tied", "pp2-vpp2-tied", "tp2xpp2", "dp2"])
def test_resize_matches_transformers(tmp_path, arch, tied, layout, ranks, cases):
    """Every rank draws as rank 0 (dp2: both replicas get transformers' rows)."""
    src = make_tiny_checkpoint(tmp_path / arch, arch, tokenizer=False, tie_word_embeddings=tied)
    got = run_distributed(_resize_world, ranks, str(src), str(tmp_path / "out"), layout, cases, timeout=400)
    for name, new, multiple, ids in cases:
        for rank in got:
            assert rank[name]["loss"] == pytest.approx(got[0][name]["loss"], rel=1e-6)
            assert torch.equal(rank[name]["after"], got[0][name]["after"])
        assert got[0][name]["returned"] == "LanguageModelEmbedding"
        _check(src, tmp_path / "out" / name, got[-1][name], new, multiple, ids)


def _refusals_world(folder: str, out_dir: str) -> dict:
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model
    from loongforge_hf.trainer.engine import MegatronEngine

    out = {}
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for key, kwargs in (("zero", {"new_num_tokens": 0}), ("float", {"new_num_tokens": 300, "pad_to_multiple_of": 1.5})):
        try:
            model.resize_token_embeddings(**kwargs)
        except ValueError as err:
            out[key] = str(err)
    out["none"] = (model.resize_token_embeddings() is not None, model.vocab_size)
    model.resize_token_embeddings(pad_to_multiple_of=64)
    out["rounded"] = model.vocab_size
    torch.manual_seed(3)
    model.resize_token_embeddings(300, mean_resizing=False)
    out["plain"] = (model.chunks[0].embedding.word_embeddings.weight[256:300].detach().clone(),
                    model.chunks[0].output_layer.weight[256:300].detach().clone())
    ids = torch.tensor([[5, 6, 7, 8]])
    engine = MegatronEngine(model, args=transformers.TrainingArguments(out_dir, use_cpu=True, report_to=[]))
    engine.train_step([{"input_ids": ids, "labels": ids}])
    try:
        model.resize_token_embeddings(400)
    except TypeError as err:
        out["held"] = str(err)
    lora = get_peft_model(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                          peft.LoraConfig(r=2, target_modules=["q_proj"]))
    try:
        lora.resize_token_embeddings(400)
    except TypeError as err:
        out["lora"] = str(err)
    return out


def test_resize_refusals_and_plain_init(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False)
    [got] = run_distributed(_refusals_world, 1, str(src), str(tmp_path / "out"), timeout=300)
    assert "new_num_tokens must be a positive integer" in got["zero"], got
    assert "pad_to_multiple_of must be a positive integer" in got["float"], got
    assert got["none"] == (True, 203) and got["rounded"] == 256, got
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(0)
    hf.resize_token_embeddings(pad_to_multiple_of=64)
    torch.manual_seed(3)
    hf.resize_token_embeddings(300, mean_resizing=False)  # normal(0, initializer_range), as transformers draws it
    assert torch.equal(got["plain"][0], hf.get_input_embeddings().weight[256:300].detach())
    assert torch.equal(got["plain"][1], hf.get_output_embeddings().weight[256:300].detach())
    assert "held by a training engine" in got["held"], got
    assert "before applying LoRA" in got["lora"], got


def _vl_world(folder: str, out_dir: str) -> dict:
    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2)
    old = model.config.text_config.vocab_size
    model.resize_token_embeddings(old + 40)
    ids = torch.tensor([[5, 6, 7, old + 3, old + 20, 11, 12]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(out_dir)
    return {"logits": logits, "ids": ids, "vocab_size": model.vocab_size, "old": old}


def test_resize_vision_language_model_tp2(tmp_path):
    """Qwen2.5-VL: the language model's embedding and LM head are resized; the exported folder loads in transformers
    with the new ``text_config.vocab_size`` and gives the same logits (fp32, 1e-4)."""
    import transformers

    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

    src = make_tiny_qwen2_5_vl(tmp_path / "vl")
    got = run_distributed(_vl_world, 2, str(src), str(tmp_path / "out"), timeout=300)[0]
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert got["vocab_size"] == hf.config.text_config.vocab_size == got["old"] + 40
    with torch.no_grad():
        ref = hf(input_ids=got["ids"]).logits
    torch.testing.assert_close(got["logits"], ref, atol=1e-4, rtol=0)
