"""PEFT's ``trainable_token_indices`` with LoRA, and adapters of a model whose vocabulary was resized, against PEFT on
the transformers model (fp32):

- the same LoraConfig (q/v adapters, four trainable tokens of a 210-token vocabulary, the pad token among them and
  in the input: its row takes no gradient from lookups, as in PEFT; the gradient was 0.96 (Llama) and 2.3e3 (tied
  Qwen3) off without that) after the same seed: logits (1e-4) and loss (1e-5); the trainable rows' gradient (1e-5)
  at TP1 and TP2; the trainable parameter count;
- the adapter folder loads with ``PeftModel.from_pretrained`` and the merged export with transformers, each giving
  our logits (1e-4); the adapter file has PEFT's tensor names and shapes; a PEFT-written adapter loads onto our model
  with the same logits;
- resized in place (203 -> 210 tokens) before LoRA: the adapter carries the embedding layers, as PEFT's does, so PEFT
  on a transformers model resized to 210 reproduces our logits though its own resize drew other rows; loading that
  adapter onto a model that was not resized fails with the resize to do, while ``from_pretrained(adapter folder)``
  resizes the base to the carried vocabulary itself (ours and PEFT's folders);
- Llama (untied) and Qwen3 with tied embeddings (the LM head's rows of the tokens are the trained ones too, as with
  PEFT's tied adapter); refused with a message: an ``lm_head`` entry, the embedding in ``modules_to_save`` as well,
  token ids outside the vocabulary, and tied embeddings under pipeline parallelism (nothing attached).
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

# NOTE: 0 is the pad token (pad_token_id), as a real input too: its row takes no gradient from lookups (PEFT's
# F.embedding with the base embedding's padding_idx), but the tied LM head's
TOKENS = [203, 0, 205, 208]
KW = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
          trainable_token_indices={"embed_tokens": TOKENS})
IDS = torch.tensor([[5, 203, 7, 205, 0, 208, 11, 203, 100, 4], [208, 6, 205, 0, 9, 10, 203, 12, 0, 14]])
DELTA = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


def _pair_world(folder: str, out_dir: str, layout: dict) -> dict:
    from ._lora_checks import export_checks, lora_pair

    model, _, ref = lora_pair(folder, layout, KW)
    ours, theirs = model(input_ids=IDS, labels=IDS), ref(input_ids=IDS, labels=IDS)
    out = {"logits": float((ours.logits - theirs.logits).abs().max()), "loss": float((ours.loss - theirs.loss).abs()),
           "counts": (model.get_nb_trainable_parameters(), ref.get_nb_trainable_parameters())}
    ours.loss.backward()
    theirs.loss.backward()
    grad = model.chunks[0].embedding.token_adapter.trainable_tokens_delta.grad
    out["grad"] = float((grad - dict(ref.named_parameters())[DELTA + ".default"].grad).abs().max())
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    out.update(export_checks(model, folder, out_dir, IDS, logits))
    return out


ARCHS = {"llama": ("llama", False), "qwen3-tied": ("qwen3", True)}


@pytest.fixture(scope="module", params=list(ARCHS))
def base210(request, tmp_path_factory):
    """(source checkpoint, the same resized to 210 tokens by transformers)."""
    import transformers

    arch, tied = ARCHS[request.param]
    tmp = tmp_path_factory.mktemp("tokens")
    src = make_tiny_checkpoint(tmp / arch, arch, tokenizer=False, tie_word_embeddings=tied)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.resize_token_embeddings(210)
    hf.save_pretrained(tmp / "base210")
    return src, tmp / "base210"


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}], ids=["tp1", "tp2"])
def test_trainable_tokens_match_peft(base210, tmp_path, layout):
    """With tied embeddings the LM head's rows of the tokens are the trained ones too (PEFT's tied adapter)."""
    from safetensors.torch import load_file

    ranks = layout.get("tensor_parallel_size", 1)
    got = run_distributed(_pair_world, ranks, str(base210[1]), str(tmp_path), layout, timeout=300)[0]
    assert got["logits"] < 1e-4 and got["loss"] < 1e-5 and got["grad"] < 1e-5, got
    assert got["counts"][0] == got["counts"][1], got
    assert got["adapter_logits_diff"] < 1e-4 and got["merged_logits_diff"] < 1e-4, got
    assert got["unchanged_after_merged_export"], got
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert tensors[DELTA].shape == (len(TOKENS), 64)
    assert not any("embed_tokens.weight" in k or "base_layer" in k or "lm_head" in k for k in tensors), sorted(tensors)


def _resized_world(src: str, out_dir: str, peft_dir: str) -> dict:
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model
    from loongforge_hf.lora.load import load_adapter

    model = lf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.resize_token_embeddings(210)
    transformers.set_seed(5)
    model = get_peft_model(model, peft.LoraConfig(**KW))
    with torch.no_grad():
        trained = model.chunks[0].embedding.token_adapter.trainable_tokens_delta
        trained.add_(0.01 * torch.randn(trained.shape, generator=torch.Generator().manual_seed(2)))
        out = {"logits": model(input_ids=IDS).logits}
    model.save_pretrained(out_dir)
    # a PEFT-written adapter (a resized transformers model, trained rows changed) onto our model, resized alike
    resized = lf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    resized.resize_token_embeddings(210)
    with torch.no_grad():
        out["peft_loaded"] = load_adapter(resized, peft_dir)(input_ids=IDS).logits
    try:
        load_adapter(lf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), peft_dir)
    except Exception as err:  # noqa: BLE001 - the message is the result
        out["not_resized"] = str(err)
    # from_pretrained(adapter folder) loads the base, resizes it to the carried vocabulary, then the adapter
    with torch.no_grad():
        out["from_peft_folder"] = lf.AutoModelForCausalLM.from_pretrained(peft_dir, dtype=torch.float32)(
            input_ids=IDS).logits
        out["from_our_folder"] = lf.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)(
            input_ids=IDS).logits
    return out


def test_adapter_of_a_resized_vocabulary_matches_peft(base210, tmp_path):
    """The adapter file has PEFT's tensor names and shapes (with tied embeddings PEFT writes the LM head's base
    weight and trained rows too)."""
    import peft
    import transformers
    from safetensors.torch import load_file

    src = base210[0]
    torch.manual_seed(7)  # NOTE: another draw of the added rows than ours: the adapter's tensors must override it
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.resize_token_embeddings(210)
    transformers.set_seed(5)
    ref = peft.get_peft_model(hf, peft.LoraConfig(**KW))
    with torch.no_grad():
        ref.base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta["default"].add_(0.02)
        ref_logits = ref(input_ids=IDS).logits
    ref.save_pretrained(tmp_path / "peft")
    got = run_distributed(_resized_world, 1, str(src), str(tmp_path / "ours"), str(tmp_path / "peft"), timeout=300)[0]

    ours = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    base.resize_token_embeddings(210)
    with torch.no_grad():
        logits = peft.PeftModel.from_pretrained(base, tmp_path / "ours")(input_ids=IDS).logits
    torch.testing.assert_close(got["logits"], logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(got["peft_loaded"], ref_logits, atol=1e-4, rtol=0)
    assert "model.resize_token_embeddings(210)" in got["not_resized"], got["not_resized"]
    torch.testing.assert_close(got["from_peft_folder"], ref_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(got["from_our_folder"], got["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, kw, match", [
    ("llama", {"trainable_token_indices": {"lm_head": [5]}}, "only the input embedding"),
    ("llama", {"trainable_token_indices": [5], "modules_to_save": ["embed_tokens"]}, "not both"),
    ("llama", {"trainable_token_indices": [5, 203]}, r"\[203\]"),
])
def test_refused(tmp_path, arch, kw, match):
    """Refused when the plan is made (every rank alike, before any change)."""
    import peft

    from loongforge_hf.lora.plan import LoraConfigError, plan_lora
    from loongforge_hf.bridges.registry import get_bridge

    from transformers import AutoConfig

    folder = make_tiny_checkpoint(tmp_path / arch, arch, tokenizer=False)
    with pytest.raises(LoraConfigError, match=match):
        plan_lora(get_bridge(AutoConfig.from_pretrained(folder)),
                  peft.LoraConfig(r=2, target_modules=["q_proj"], **kw))


def _resume_world(folder: str, out_dir: str) -> dict:
    from ._sft_parity import resume_matches_uninterrupted

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], trainable_token_indices=list(range(4, 40)))
    return resume_matches_uninterrupted(folder, out_dir, {"tensor_parallel_size": 2}, lora)


def test_trainable_tokens_resume_from_a_checkpoint(tmp_path):
    """TP2: a run resumed from its step-2 checkpoint logs the uninterrupted run's losses (the trained rows are in the
    checkpoint, with their optimizer state)."""
    src = make_tiny_checkpoint(tmp_path / "llama", "llama")
    got = run_distributed(_resume_world, 2, str(src), str(tmp_path / "run"), timeout=400)[0]
    assert got["resumed"] == got["full"] and len(got["full"]) == 4, got


def _tied_pp2_world(folder: str) -> str:
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2)
    try:
        get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices=[5]))
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err} / lora={any('lora' in n for n, _ in model.named_parameters())}"
    return "applied"


def test_tied_trainable_tokens_refused_under_pipeline_parallelism(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", tokenizer=False, tie_word_embeddings=True)
    for message in run_distributed(_tied_pp2_world, 2, str(folder), timeout=300):
        assert message.startswith("LoraConfigError") and "pipeline_parallel_size=2" in message, message
        assert message.endswith("lora=False"), message  # nothing attached


def _layout_world(folder: str, out_dir: str, layouts: dict) -> dict:
    from ._sft_parity import run_loong

    scenario = {"tokens": ("text", {"learning_rate": 2e-2},
                           dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                trainable_token_indices=list(range(4, 60))))}
    return {name: run_loong(folder, f"{out_dir}/{name}", layout, ["tokens"], scenario)["tokens"]["losses"]
            for name, layout in layouts.items()}


def test_tied_trainable_tokens_train_alike_in_every_layout(tmp_path):
    """Qwen3 with tied embeddings, LoongSFTTrainer with trainable tokens (the rows trained through the embedding and
    the LM head): TP2 and TP2 with sequence parallelism log TP1's losses (1e-5 relative; TP1's forward and gradients
    are PEFT's, test_trainable_tokens_match_peft). trl.SFTTrainer itself fails on this model
    ('TrainableTokensWrapper' object has no attribute 'bias', trl 1.16), so TP1 is the reference."""
    folder = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", tie_word_embeddings=True)
    [one] = run_distributed(_layout_world, 1, str(folder), str(tmp_path), {"tp1": {}}, timeout=300)
    two = run_distributed(_layout_world, 2, str(folder), str(tmp_path),
                          {"tp2": {"tensor_parallel_size": 2},
                           "tp2sp": {"tensor_parallel_size": 2, "sequence_parallel": True}}, timeout=400)[0]
    assert len(one["tp1"]) == 3 and one["tp1"][0] != one["tp1"][-1], one
    for name in ("tp2", "tp2sp"):
        assert two[name] == pytest.approx(one["tp1"], rel=1e-5), (name, two[name], one["tp1"])
