"""``SFTConfig(chat_template_path=<tokenizer folder>)``: TRL's ``clone_chat_template`` copies the folder's chat
template, adds its special tokens and resizes the model's embeddings (to a multiple of 64); with a LoraConfig TRL then
also trains the added tokens' embedding rows (PEFT's ``trainable_token_indices``) and the LM head. LoongSFTTrainer at
TP=1, TP=2, TP=2 with sequence parallelism and PP=2 logs trl.SFTTrainer's losses (with PEFT for LoRA) on the
transformers model within 1e-4 relative (fp32), the saved folder loads in transformers with the resized vocabulary
(the tokenizer as long), and the saved adapter on the transformers model gives the trained model's logits (1e-4)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

from ._sft_parity import _losses, make_dataset, sft_config

TEMPLATE = ("{% for message in messages %}<|im_start|> {{ message['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> {% endif %}")


def _template_source(folder) -> str:
    tok = make_tiny_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return str(folder)


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _run(folder: str, template: str, out_dir: str, layout: dict | None, lora: bool, **overrides) -> dict:
    import peft
    import transformers
    import trl

    import loongforge_hf as lf

    args = sft_config(out_dir, chat_template_path=template, **({"learning_rate": 2e-2} if lora else {}), **overrides)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    kw = dict(args=args, train_dataset=make_dataset("messages"), processing_class=tokenizer,
              peft_config=peft.LoraConfig(**LORA) if lora else None)
    if layout is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = trl.SFTTrainer(model=model, **kw)
    else:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        trainer = lf.LoongSFTTrainer(model=model, **kw)
    trainer.train()
    trainer.save_model(out_dir + "/final")
    out = {"losses": _losses(trainer), "vocab": trainer.model.vocab_size, "tokens": len(trainer.processing_class),
           "eos": (trainer.processing_class.eos_token, trainer.model.config.eos_token_id,
                   trainer.model.generation_config.eos_token_id, args.eos_token)}
    if lora and layout is not None:
        # the trained model's logits against PEFT's with the saved adapter on the resized transformers model
        ids = torch.tensor([[203, 5, 6, 204, 7, 8, 203, 9, 204, 10]])
        with torch.no_grad():
            out["logits"] = trainer.model(input_ids=ids).logits
        out["ids"] = ids
    return out


def _world(folder: str, template: str, out_dir: str, layouts: dict) -> dict:
    """{name: run} for each ``layouts`` entry (None: trl.SFTTrainer on the transformers model), full fine-tuning and
    LoRA (TRL then trains the added tokens' embedding rows, PEFT's trainable_token_indices, and the LM head)."""
    return {f"{name}{suffix}": _run(folder, template, f"{out_dir}/{name}{suffix}", layout, lora=bool(suffix))
            for name, layout in layouts.items() for suffix in ("", "_lora")}


TWO_RANKS = {"tp2": {"tensor_parallel_size": 2}, "tp2sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
             "pp2": {"pipeline_parallel_size": 2}}


def test_clone_chat_template_matches_trl(tmp_path):
    import peft
    import transformers

    src = make_tiny_checkpoint(tmp_path / "llama", "llama")
    template = _template_source(tmp_path / "template")
    [one] = run_distributed(_world, 1, str(src), template, str(tmp_path), {"trl": None, "tp1": {}}, timeout=400)
    two = run_distributed(_world, 2, str(src), template, str(tmp_path), TWO_RANKS, timeout=600)
    runs = {**one, **two[-1]}
    for suffix in ("", "_lora"):
        ref = runs["trl" + suffix]
        assert ref["vocab"] == ref["tokens"] == 256, ref  # 203 + 2 special tokens, rounded up to 64 by TRL
        for name in ("tp1", *TWO_RANKS):
            got = runs[name + suffix]
            assert got["vocab"] == got["tokens"] == 256, (name + suffix, got)
            assert len(got["losses"]) == len(ref["losses"]) == 3
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4), name + suffix
    for name in ("tp1", *TWO_RANKS):
        folder = tmp_path / name / "final"
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        assert model.config.vocab_size == len(tokenizer) == 256
        assert tokenizer.chat_template == TEMPLATE and tokenizer.eos_token == "<|im_end|>"
        # the adapter (LoRA, the added tokens' trained rows, the LM head, the resized embedding) on the transformers
        # model resized as TRL resizes it: the trained model's logits (1e-4)
        got = runs[name + "_lora"]
        base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        base.resize_token_embeddings(256)
        loaded = peft.PeftModel.from_pretrained(base, tmp_path / f"{name}_lora" / "final")
        with torch.no_grad():
            logits = loaded(input_ids=got["ids"]).logits
        torch.testing.assert_close(got["logits"], logits, atol=1e-4, rtol=0)


def _eos_world(folder: str, template: str, out_dir: str) -> dict:
    return {name: _run(folder, template, f"{out_dir}/{name}", layout, lora=True, eos_token="tok7")
            for name, layout in (("trl", None), ("tp1", {}))}


def test_eos_token_with_a_cloned_template_and_lora(tmp_path):
    """SFTConfig(eos_token=...) with a cloned template under LoRA: TRL sets the EOS token, then the clone replaces it
    with the template's; LoongSFTTrainer (which clones before applying LoRA) ends with the same tokens, ids and
    losses, and leaves ``args.eos_token`` as given."""
    src = make_tiny_checkpoint(tmp_path / "llama", "llama")
    template = _template_source(tmp_path / "template")
    [got] = run_distributed(_eos_world, 1, str(src), template, str(tmp_path), timeout=400)
    assert got["trl"]["eos"][0] == "<|im_end|>" and got["trl"]["eos"][3] == "tok7", got["trl"]
    assert got["tp1"]["eos"] == got["trl"]["eos"], got
    assert got["tp1"]["losses"] == pytest.approx(got["trl"]["losses"], rel=1e-4)
