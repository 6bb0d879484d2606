"""``SFTConfig(chat_template_path=<tokenizer folder>)``: TRL's ``clone_chat_template`` copies the folder's chat
template, adds its special tokens and resizes the model's embeddings (to a multiple of 64); LoongSFTTrainer at TP=1
and TP=2 then logs trl.SFTTrainer's losses on the transformers model within 1e-4 relative (fp32; the added rows
differ only by transformers' tiny random spread around the old rows' mean), and the saved folder loads in transformers
with the resized vocabulary, the tokenizer as long."""

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


def _run(folder: str, template: str, out_dir: str, layout: dict | None) -> dict:
    import transformers
    import trl

    import loongforge_hf as lf

    args = sft_config(out_dir, chat_template_path=template)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if layout is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=make_dataset("messages"),
                                 processing_class=tokenizer)
    else:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=make_dataset("messages"),
                                     processing_class=tokenizer)
    trainer.train()
    trainer.save_model(out_dir + "/final")
    return {"losses": _losses(trainer), "vocab": model.vocab_size, "tokens": len(trainer.processing_class)}


def _world(folder: str, template: str, out_dir: str, layouts: dict) -> dict:
    """{name: run} for each ``layouts`` entry (None: trl.SFTTrainer on the transformers model)."""
    return {name: _run(folder, template, f"{out_dir}/{name}", layout) for name, layout in layouts.items()}


def test_clone_chat_template_matches_trl(tmp_path):
    import transformers

    src = make_tiny_checkpoint(tmp_path / "llama", "llama")
    template = _template_source(tmp_path / "template")
    [one] = run_distributed(_world, 1, str(src), template, str(tmp_path), {"trl": None, "tp1": {}}, timeout=400)
    two = run_distributed(_world, 2, str(src), template, str(tmp_path), {"tp2": {"tensor_parallel_size": 2}},
                          timeout=400)
    ref = one["trl"]
    assert ref["vocab"] == ref["tokens"] == 256, ref  # 203 + 2 special tokens, rounded up to 64 by TRL
    for got in (one["tp1"], two[0]["tp2"]):
        assert got["vocab"] == got["tokens"] == 256, got
        assert len(got["losses"]) == len(ref["losses"]) == 3
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    for folder in (tmp_path / "tp1" / "final", tmp_path / "tp2" / "final"):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        assert model.config.vocab_size == len(tokenizer) == 256
        assert tokenizer.chat_template == TEMPLATE and tokenizer.eos_token == "<|im_end|>"
