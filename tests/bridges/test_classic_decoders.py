"""The classic decoders (Persimmon, CodeGen, GPT-Neo, OPT, GPT-NeoX-Japanese, BioGPT, XGLM) beyond the shared suites
(parity at TP1 and TP2 + SP and round trips: test_dense_parity; gradients at TP2 + SP: test_gradients): what megatron
cannot reproduce refused by the bridges' pure checks naming the field, BLOOM and MPT (ALiBi) refused by name with
the reason; in one world, OPT's hub layout (names without ``model.``) with positions far down its offset table, a
right-padded batch and a left-padded one without position_ids (transformers' counted from the mask), and greedy
generate with the KV cache for GPT-Neo (local layers' windows across the steps) and OPT (left-padded, the static
cache) against transformers."""

import re

import pytest
import torch

from loongforge_hf.bridges import UnsupportedArchitectureError, UnsupportedConfigError, get_bridge
from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.round_trip import read_all
from loongforge_hf.testing.tiny_models import _config

TOL = 1e-4
NAMES = {"persimmon": "PersimmonForCausalLM", "codegen": "CodeGenForCausalLM", "gpt_neo": "GPTNeoForCausalLM",
         "opt": "OPTForCausalLM", "gpt_neox_japanese": "GPTNeoXJapaneseForCausalLM", "biogpt": "BioGptForCausalLM",
         "xglm": "XGLMForCausalLM"}


@pytest.mark.parametrize("arch,overrides,field", [
    ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before=False"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim=32"),
    ("opt", {"_remove_final_layer_norm": True}, "_remove_final_layer_norm=True"),
    ("opt", {"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine=False"),
    ("opt", {"layerdrop": 0.1}, "layerdrop=0.1"),
    ("gpt_neo", {"attention_layers": ["global", "sparse", "global", "local"]}, "attention_layers="),
    ("gpt_neo", {"window_size": 0}, "window_size=0"),
    ("codegen", {"n_head": 2}, "n_head=2"),
    ("codegen", {"rotary_dim": 7}, "rotary_dim=7 is not supported for CodeGenForCausalLM"),
    ("persimmon", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                       "original_max_position_embeddings": 32}}, "yarn"),
    ("gpt_neox_japanese", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("biogpt", {"activation_dropout": 0.1}, "activation_dropout=0.1"), ("biogpt", {"layerdrop": 0.1}, "layerdrop=0.1"),
    ("xglm", {"activation_dropout": 0.1}, "activation_dropout=0.1"),
    ("xglm", {"add_cross_attention": True}, "add_cross_attention=True"),
])
def test_fields_megatron_cannot_express_refused(arch, overrides, field):
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        get_bridge(_config(arch, architectures=[NAMES[arch]], **overrides))


@pytest.mark.parametrize("config,arch,reason", [
    ("BloomConfig", "BloomForCausalLM", "ALiBi"), ("MptConfig", "MptForCausalLM", "ALiBi")])
def test_decoders_needing_new_layers_refused_by_name(config, arch, reason):
    import transformers

    cfg = getattr(transformers, config)(architectures=[arch])
    with pytest.raises(UnsupportedArchitectureError, match=f"{arch} is not supported: .*{reason}.*OPTForCausalLM"):
        get_bridge(cfg)


def _opt_hub_copy(src, dst) -> None:
    """``src`` (transformers' save) as the hub's OPT checkpoints store it: one file, names without ``model.``."""
    from safetensors.torch import save_file

    dst.mkdir()
    save_file({n.removeprefix("model."): t for n, t in read_all(src).items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    for side in src.iterdir():
        if side.suffix != ".safetensors" and side.name != "model.safetensors.index.json":
            (dst / side.name).write_bytes(side.read_bytes())


def _checks(opt: str, neo: str, out_dir: str) -> dict:
    import transformers

    import loongforge_hf as lf

    out = {}
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(5))
    right = torch.ones_like(ids)
    right[1, -4:] = 0
    left = right.flip(-1)
    for name, folder in (("opt", opt), ("gpt_neo", neo)):
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        kw = dict(input_ids=ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
        if name == "opt":  # NOTE: generate's positions from the left-padded mask, through the static cache
            kw["attention_mask"] = left
        with torch.no_grad():
            got = model.generate(**kw, cache_implementation="static" if name == "opt" else "dynamic")
            want = ref.generate(**kw)
            out[f"{name}_generate"] = (torch.equal(got.sequences, want.sequences),
                                       float(max((a - b).abs().max() for a, b in zip(got.scores, want.scores))))
            if name != "opt":
                continue
            far = torch.arange(100, 112).expand(2, 12)  # NOTE: rows 102 .. 113 of the table
            out["far"] = float((model(input_ids=ids, position_ids=far).logits
                                - ref(input_ids=ids, position_ids=far).logits).abs().max())
            real = right.bool()
            out["right_padded"] = float((model(input_ids=ids, attention_mask=right).logits
                                         - ref(input_ids=ids, attention_mask=right).logits)[real].abs().max())
            kw = dict(input_ids=ids, attention_mask=left, labels=ids.masked_fill(left == 0, -100))
            got, want = model(**kw), ref(**kw)
            out["left_padded"] = max(float((got.logits - want.logits)[left.bool()].abs().max()),
                                     abs(float(got.loss) - float(want.loss)))
            model.save_pretrained(out_dir)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("classic")
    _opt_hub_copy(make_tiny_checkpoint(base / "opt_src", "opt"), base / "opt_hub")
    neo = make_tiny_checkpoint(base / "neo", "gpt_neo")
    [r] = run_distributed(_checks, 1, str(base / "opt_hub"), str(neo), str(base / "opt_out"), timeout=300)
    return r, base


def test_opt_hub_layout_positions_and_padding(results):
    """OPT's hub checkpoint (``decoder.*``) loads through the alias with transformers' logits at positions far down
    its offset table and on a right-padded and a left-padded batch without position_ids (transformers counts them
    from each row's first real token: ``absolute_positions.mask_positions``; the logits and the loss); export writes
    transformers' names (``model.decoder.*``) bit for bit."""
    r, base = results
    assert r["far"] < TOL and r["right_padded"] < TOL and r["left_padded"] < TOL, r
    theirs = {f"model.{n}": t for n, t in read_all(base / "opt_hub").items()}
    ours = read_all(base / "opt_out")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


@pytest.mark.parametrize("name", ["gpt_neo", "opt"])
def test_cached_greedy_generate(results, name):
    """12 prompt tokens + 8 new with the KV cache: transformers' tokens and scores (GPT-Neo's window of 5 slides over
    the cached keys; OPT's offset positions, counted from a left-padded row's first real token, in the static cache)."""
    same, diff = results[0][f"{name}_generate"]
    assert same and diff < TOL, (same, diff)
