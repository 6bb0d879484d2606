"""GPT-2 beyond the shared suites: a checkpoint saved without the ``transformer.`` prefix (OpenAI's ``gpt2`` on the hub,
with its ``attn.bias`` / ``attn.masked_bias`` buffers) loads with transformers' logits and exports the names
transformers writes, bit for bit; learned positions past ``n_positions`` are refused before anything runs."""

import json

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.round_trip import read_all

TOL = 1e-4


def _unprefixed_copy(src, dst) -> None:
    """``src`` (transformers' save) rewritten as OpenAI's ``gpt2`` is stored: one file, no ``transformer.`` prefix, the
    causal-mask buffers of old checkpoints beside each layer's attention."""
    from safetensors.torch import save_file

    tensors = {name.removeprefix("transformer."): t for name, t in read_all(src).items()}
    n = json.loads((src / "config.json").read_text())["n_positions"]
    for layer in range(4):
        tensors[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        tensors[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for side in src.iterdir():
        if side.suffix != ".safetensors" and side.name != "model.safetensors.index.json":
            (dst / side.name).write_bytes(side.read_bytes())


def _load_compare_refuse(folder: str, out_dir: str) -> dict:
    import transformers

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(0, 203, (2, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(100, 112).expand(2, 12)  # NOTE: far down the table: the positions are read
    with torch.no_grad():
        diff = float((model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())
        moved = float((model(input_ids=ids, position_ids=positions).logits
                       - ref(input_ids=ids, position_ids=positions).logits).abs().max())
    refused = {}
    for name, kwargs in {"too_long": dict(input_ids=torch.zeros(1, 129, dtype=torch.long)),
                         "past_the_table": dict(input_ids=ids, position_ids=positions + 17),
                         "negative": dict(input_ids=ids, position_ids=positions - 101)}.items():
        try:
            model(**kwargs)
            refused[name] = None
        except ValueError as err:
            refused[name] = str(err)
    model.save_pretrained(out_dir)
    return {"diff": diff, "moved": moved, "refused": refused}


def test_checkpoint_without_prefix_and_too_long_inputs(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "gpt2")
    legacy = tmp_path / "legacy"
    _unprefixed_copy(src, legacy)
    (res,) = run_distributed(_load_compare_refuse, 1, str(legacy), str(tmp_path / "out"), timeout=180)
    assert res["diff"] < TOL and res["moved"] < TOL, res
    assert "129 positions" in res["refused"]["too_long"] and "max_position_embeddings=128" in res["refused"]["too_long"]
    assert "from 117 to 128" in res["refused"]["past_the_table"], res["refused"]
    assert "from -1 to 10" in res["refused"]["negative"], res["refused"]
    exported, written = read_all(tmp_path / "out"), read_all(src)
    assert sorted(exported) == sorted(written)  # NOTE: transformers' names; the buffers are not written back
    assert all(torch.equal(exported[n], written[n]) for n in written)


@pytest.mark.parametrize("field, value, match", [
    ("scale_attn_weights", False, r"scale_attn_weights=False is not supported for GPT2LMHeadModel"),
    ("scale_attn_by_inverse_layer_idx", True, r"scale_attn_by_inverse_layer_idx=True is not supported"),
    ("reorder_and_upcast_attn", True, r"reorder_and_upcast_attn=True is not supported"),
    ("add_cross_attention", True, r"add_cross_attention=True is not supported"),
    ("activation_function", "relu", r"hidden_act='relu' is not supported")])
def test_fields_megatron_cannot_express_refused(field, value, match):
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.testing.tiny_models import _config

    with pytest.raises(UnsupportedConfigError, match=match):
        get_bridge(_config("gpt2", **{field: value}))


def test_settings_taken():
    """The hub's settings: the three dropouts each where transformers puts it, ``n_inner`` None as 4 x ``n_embd``,
    LayerNorms and biases, learned positions, the tied head; ``token_type_ids`` refused by the forward."""
    import types

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.modeling import LoongModelForCausalLM
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("gpt2", resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3, n_inner=None))
    kw = bridge.transformer_config_kwargs()
    assert kw["hidden_dropout"] == 0.1 and bridge.embedding_dropout == 0.2 and kw["attention_dropout"] == 0.3
    assert kw["ffn_hidden_size"] == 256 and kw["normalization"] == "LayerNorm" and not kw["gated_linear_unit"]
    assert kw["add_bias_linear"] and kw["add_qkv_bias"] and kw["layernorm_epsilon"] == 1e-5 and bridge.tied
    assert bridge.position_embedding_type == "learned_absolute"
    assert bridge.expected_hf_shapes()["transformer.wpe.weight"] == (128, 64)
    with pytest.raises(TypeError, match=r"token_type_ids are not supported for GPT2LMHeadModel"):
        LoongModelForCausalLM.forward(types.SimpleNamespace(bridge=bridge), torch.zeros(1, 3, dtype=torch.long),
                                      token_type_ids=torch.zeros(1, 3, dtype=torch.long))
