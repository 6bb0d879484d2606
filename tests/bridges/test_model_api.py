"""What a transformers / PEFT user does with a loaded model, one CPU process, against transformers and PEFT.

- ``from_pretrained`` returns the model in eval mode (dropout off: the same logits twice, equal to transformers' in
  eval mode), and ``dtype`` defaults to ``"auto"`` (the config's dtype, else the first tensor's), as transformers 5.
- ``forward`` honours ``num_items_in_batch`` (summed loss / it), ``logits_to_keep`` and ``return_dict=False`` like
  transformers, and refuses what it cannot honour (hidden states, a cache other than the one generate makes,
  logits_to_keep with labels).
- ``save_pretrained`` writes config.json verbatim when nothing changed, the user's config / generation config changes
  otherwise, with the dtype of the tensors written; transformers keywords that would change what is written are
  refused before anything is written; extra chat templates are copied.
- ``num_parameters()`` does not count megatron's vocabulary padding rows (nor those of Phi's LM head bias).
- An embedding dropout other than the sublayers' (Phi-2's ``embd_pdrop``, StarCoder2's ``embedding_dropout``) is the
  embedding's own; ``resize_token_embeddings`` is refused for an LM head with a bias. StableLM's ``hidden_dropout``
  drops the MLP's output alone, GPT-J's ``resid_pdrop`` both sublayers' (probability 1: transformers' logits).
- A LoRA adapter folder loads with PEFT's ``AutoPeftModelForCausalLM`` (``auto_mapping``), same logits.

Tolerances: fp32 logits 1e-5, losses 1e-6 relative.
"""

import json

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._model_api import model_api_checks, peft_auto_load


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    folders = {"qwen3": make_tiny_checkpoint(tmp / "qwen3", "qwen3", vocab_size=203),
               "dropout": make_tiny_checkpoint(tmp / "dropout", "qwen2", tokenizer=False, attention_dropout=0.3),
               "bf16": make_tiny_checkpoint(tmp / "bf16", "llama", tokenizer=False, dtype=torch.bfloat16),
               "tied": make_tiny_checkpoint(tmp / "tied", "qwen3", tokenizer=False, tie_word_embeddings=True),
               # NOTE: phi-2's dropouts (the embedding's 0, the sublayers' 0.1) and StarCoder2's alike
               "phi_dropouts": make_tiny_checkpoint(tmp / "phi_dropouts", "phi", tokenizer=False, embd_pdrop=0.0,
                                                    resid_pdrop=0.1),
               "phi_tied": make_tiny_checkpoint(tmp / "phi_tied", "phi", tokenizer=False, tie_word_embeddings=True),
               "starcoder2_dropouts": make_tiny_checkpoint(tmp / "starcoder2_dropouts", "starcoder2", tokenizer=False,
                                                           embedding_dropout=0.0, residual_dropout=0.1),
               # NOTE: dropouts of probability 1 (deterministic): StableLM's on the MLP output, GPT-J's on both
               # sublayers' outputs, its embedding's 0
               "stablelm_dropouts": make_tiny_checkpoint(tmp / "stablelm_dropouts", "stablelm", tokenizer=False,
                                                         hidden_dropout=1.0),
               "gptj_dropouts": make_tiny_checkpoint(tmp / "gptj_dropouts", "gptj", tokenizer=False, resid_pdrop=1.0,
                                                     embd_pdrop=0.0)}
    no_dtype = make_tiny_checkpoint(tmp / "no_dtype", "llama", tokenizer=False, dtype=torch.bfloat16)
    cfg = json.loads((no_dtype / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (no_dtype / "config.json").write_text(json.dumps(cfg))
    folders["no_dtype_field"] = no_dtype
    templates = make_tiny_checkpoint(tmp / "templates", "qwen3")
    (templates / "additional_chat_templates").mkdir()
    (templates / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    folders["templates"] = templates
    res = run_distributed(model_api_checks, 1, {k: str(v) for k, v in folders.items()}, str(tmp / "out"),
                          timeout=300)[0]
    return res, folders, tmp / "out"


def test_loaded_in_eval_mode_and_trained_in_train_mode(api):
    res = api[0]["eval"]
    assert (res["training"], res["ref_training"]) == (False, False)
    assert res["repeat_diff"] == 0.0 and res["vs_ref"] < 1e-5, res
    assert res["training_after_step"]


def test_dtype_defaults_to_auto_like_transformers(api):
    dtypes = api[0]["dtype"]
    assert dtypes["bf16"] == ("torch.bfloat16", "torch.bfloat16")
    assert dtypes["no_dtype_field"] == ("torch.bfloat16", "torch.bfloat16")


def test_forward_keywords_as_transformers(api):
    fwd = api[0]["forward"]
    got, exp = fwd["num_items"]
    assert got == pytest.approx(exp, rel=1e-6)
    assert fwd["keep_shape"][0] == fwd["keep_shape"][1] == (2, 1, 203)
    assert fwd["keep_diff"] < 1e-5
    kind, length, loss_diff = fwd["tuple"]
    assert kind == "tuple" and length == 2 and loss_diff < 1e-5
    refused = fwd["refused"]
    assert "output_hidden_states" in refused["output_hidden_states"]
    assert "past_key_values" in refused["past_key_values"]
    assert "logits_to_keep with labels" in refused["logits_to_keep"]


def test_num_parameters_leaves_out_vocab_padding(api):
    ours, theirs = api[0]["num_parameters"]
    assert ours == theirs
    # transformers' positional only_trainable and exclude_embeddings (what its floating_point_ops and users ask)
    for ours, theirs in api[0]["num_parameters_variants"]:
        assert ours == theirs


def test_embedding_dropout_of_its_own_and_the_lm_head_bias(api):
    """Phi-2's ``embd_pdrop`` (0) and StarCoder2's ``embedding_dropout`` (0) drop the embedding output while the
    sublayers' dropout (megatron's ``hidden_dropout``) is 0.1; Phi's LM head bias counts as in transformers (its
    padding rows left out, tied or not), and resizing the vocabulary is refused for it."""
    res = api[0]
    assert res["embedding_dropout"] == {"phi_dropouts": (0.0, 0.1), "phi_tied": (0.0, 0.0),
                                        "starcoder2_dropouts": (0.0, 0.1)}
    for ours, theirs in res["num_parameters_bias"]:
        assert ours == theirs
    assert "resize_token_embeddings is not supported for PhiForCausalLM" in res["resize_bias"]


def test_dropouts_fall_where_transformers_puts_them(api):
    """In training mode with a dropout probability of 1 (so both sides drop the same: everything): StableLM's
    ``hidden_dropout`` drops the MLP's output only (the attention's and the embedding's kept), GPT-J's ``resid_pdrop``
    both sublayers' outputs and not the embedding's (``embd_pdrop`` 0): transformers' logits within 1e-5."""
    for name, diff in api[0]["dropout_placement"].items():
        assert diff < 1e-5, (name, diff)


def test_save_follows_config_changes_and_dtype(api):
    res, folders, _ = api
    assert res["same_config_verbatim"]
    changed = res["changed"]
    assert changed["use_cache"] is False and changed["my_field"] == "kept" and changed["max_new_tokens"] == 77
    assert changed["dtype"] == "bfloat16" and changed["reloaded_dtype"] == "torch.bfloat16"
    assert changed["tensor_dtypes"] == ["torch.bfloat16"]
    assert res["bf16_as_fp32"] == "float32"
    assert res["templates"] == ["tool_use.jinja"]


def test_save_refuses_keywords_it_cannot_honour(api):
    res = api[0]
    for key in ("state_dict", "push_to_hub", "safe_serialization"):
        assert res["save_refused"][key] is not None and key in res["save_refused"][key], res["save_refused"]
    assert res["save_refused_left_nothing"]
    assert (api[2] / "accepted" / "config.json").is_file()


def test_lora_adapter_loads_with_peft_auto_class(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "base", "qwen3")
    res = run_distributed(peft_auto_load, 1, str(folder), str(tmp_path / "adapter"), timeout=300)[0]
    assert res["auto_mapping"] == {"base_model_class": "Qwen3ForCausalLM",
                                   "parent_library": "transformers.models.qwen3.modeling_qwen3"}
    assert res["diff"] < 1e-5


def test_output_cache_field_of_either_transformers():
    """The forward's output puts the cache in the output class's cache field: ``cache`` in this transformers,
    ``past_key_values`` in transformers 5.17 (a class with that field stands in for it)."""
    import dataclasses

    from transformers.modeling_outputs import CausalLMOutputWithPast

    from loongforge_hf.modeling import with_cache

    @dataclasses.dataclass
    class Older:
        loss: object = None
        logits: object = None
        past_key_values: object = None

    marker = object()
    assert with_cache(Older, marker, logits=1).past_key_values is marker
    field = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
    assert getattr(with_cache(CausalLMOutputWithPast, marker, logits=1), field) is marker
