"""transformers' ``from_pretrained`` keywords (``bridges/load_kwargs.py``), against transformers itself.

- One CPU process, each case loaded by both libraries with the same keywords: config overrides (``use_cache``,
  ``max_position_embeddings``, a llama3 ``rope_scaling``) with ``attn_implementation``, ``generation_config`` and
  ``output_loading_info`` give a ``model.config`` equal to transformers', the same loading info, logits within 1e-4
  (and the rope override moves them, so it is seen), and ``save_pretrained`` writes the config.json and
  generation_config.json transformers' ``save_pretrained`` writes. An MoE config override (``output_router_logits``,
  ``router_aux_loss_coef``) reaches the loss as in transformers. ``config=`` an object or a path, ``variant``,
  ``use_safetensors`` and ``subfolder`` (through a local hub cache, offline) load the weights and config transformers
  loads, each checkpoint built so that the plain load would differ. Keywords transformers refuses are refused.
  Qwen2.5-VL (``AutoModelForImageTextToText``): a ``text_config`` override gives transformers' config, loading info
  and, saved and reloaded, its config (the sub-configs' dtype aside, which transformers' save adds).
- Two CPU processes at TP2: refused keywords raise the same error on both ranks before the process group starts; then
  a load with config overrides gives transformers' logits.
"""

import json
import shutil

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .._hub_cache import put_in_hub_cache

TOL = 1e-4  # fp32 logits, as tests/bridges/test_dense_parity.py
CPU = {"LOONGFORGE_DEVICE": "cpu"}
ROPE = {"rope_scaling": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}
OVERRIDES = {"use_cache": False, "max_position_embeddings": 256, **ROPE}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny llama checkpoints: ``plain``; ``multi`` with plain safetensors (seed 0), an ``fp16`` variant (seed 1) and
    pytorch_model.bin (seed 2); ``pickle_only``; ``cfg`` (a config.json alone); a hub cache whose repo holds one
    checkpoint at its top level and another under ``sub/``; a tiny Qwen3-MoE and a tiny Qwen2.5-VL."""
    import transformers

    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

    tmp = tmp_path_factory.mktemp("fpkw")
    plain = make_tiny_checkpoint(tmp / "plain", "llama", tokenizer=False)
    multi = make_tiny_checkpoint(tmp / "multi", "llama", tokenizer=False)
    other = make_tiny_checkpoint(tmp / "seed1", "llama", seed=1, tokenizer=False)
    transformers.AutoModelForCausalLM.from_pretrained(other).save_pretrained(tmp / "v", variant="fp16",
                                                                             max_shard_size="100KB")
    for f in (tmp / "v").glob("*fp16*"):
        shutil.copy(f, multi / f.name)
    torch.manual_seed(2)
    bin_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(plain))
    torch.save(bin_model.state_dict(), multi / "pytorch_model.bin")
    (tmp / "pickle_only").mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        shutil.copy(multi / name, tmp / "pickle_only" / name)
    (tmp / "cfg").mkdir()
    cfg = json.loads((plain / "config.json").read_text())
    (tmp / "cfg" / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 512, "use_cache": False}))
    top = {p.name: p.read_bytes() for p in other.iterdir()}
    put_in_hub_cache(tmp / "hub", "org/tiny", {**top, **{f"sub/{p.name}": p.read_bytes() for p in plain.iterdir()}})
    moe = make_tiny_checkpoint(tmp / "moe", "qwen3_moe", tokenizer=False)
    vl = make_tiny_qwen2_5_vl(tmp / "vl", max_shard_size="1MB")
    return {"plain": str(plain), "multi": str(multi), "pickle_only": str(tmp / "pickle_only"), "cfg": str(tmp / "cfg"),
            "hub": str(tmp / "hub"), "moe": str(moe), "vl": str(vl), "out": str(tmp / "out")}


# ---- inside the ranks ------------------------------------------------------------------------------------------------

def _ids():
    return torch.randint(0, 203, (2, 40), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids()).logits.float()


def _error(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares what each library raised
        return type(err).__name__, str(err)
    return "no error", ""


def _json(path) -> dict:
    data = json.loads(open(path).read())
    data.pop("transformers_version", None)
    return data


def _no_dtype(config: dict) -> dict:
    """A config dict without its and its sub-configs' dtype and name."""
    return {k: _no_dtype(v) if isinstance(v, dict) else v for k, v in config.items()
            if k not in ("dtype", "torch_dtype", "_name_or_path")}


def single_process_cases(c: dict) -> dict:
    import transformers as tf
    from transformers import AutoModelForCausalLM as Ref

    import loongforge_hf as lf

    load = lf.AutoModelForCausalLM.from_pretrained
    out = {}
    plain_ref = _logits(Ref.from_pretrained(c["plain"]))

    # config overrides + attn_implementation + generation_config + output_loading_info, and their export
    kw = dict(OVERRIDES, attn_implementation="eager", generation_config=tf.GenerationConfig(max_new_tokens=7),
              output_loading_info=True)
    model, info = load(c["plain"], device_map="auto", low_cpu_mem_usage=True, **kw)
    ref, ref_info = Ref.from_pretrained(c["plain"], **kw)
    mine, theirs = model.config.to_dict(), ref.config.to_dict()
    out["config_diff"] = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs)
                          if mine.get(k) != theirs.get(k)}
    out["attn"] = (model.config._attn_implementation, ref.config._attn_implementation)
    out["info"] = (info, ref_info)
    logits = _logits(model)
    out["override_diff"] = (logits - _logits(ref)).abs().max().item()
    out["override_moves"] = (logits - plain_ref).abs().max().item()
    model.save_pretrained(f"{c['out']}/lf")
    ref.save_pretrained(f"{c['out']}/tf")
    out["saved"] = {name: (_json(f"{c['out']}/lf/{name}"), _json(f"{c['out']}/tf/{name}"))
                    for name in ("config.json", "generation_config.json")}

    # MoE: config overrides the forward reads (the aux loss enters the loss)
    kw = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    model, ref = load(c["moe"], **kw), Ref.from_pretrained(c["moe"], **kw)
    ids = _ids()
    mine, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out["moe"] = {"config_equal": model.config.to_dict() == ref.config.to_dict(),
                  "loss_diff": abs(mine.loss.item() - theirs.loss.item()),
                  "aux_diff": abs(mine.aux_loss.item() - theirs.aux_loss.item()), "aux": theirs.aux_loss.item()}

    # a vision-language model: a text_config override; a text field at the top level is refused by both
    kw = {"text_config": {"use_cache": False, "max_position_embeddings": 512}, "output_loading_info": True,
          "attn_implementation": "sdpa"}
    model, info = lf.AutoModelForImageTextToText.from_pretrained(c["vl"], **kw)
    ref, ref_info = tf.AutoModelForImageTextToText.from_pretrained(c["vl"], **kw)
    model.save_pretrained(f"{c['out']}/vl_lf")
    ref.save_pretrained(f"{c['out']}/vl_tf")
    reloaded = [_no_dtype(tf.AutoConfig.from_pretrained(f"{c['out']}/vl_{n}").to_dict()) for n in ("lf", "tf")]
    out["vl"] = {"text": (model.config.text_config.to_dict(), ref.config.text_config.to_dict()),
                 "info": (info, ref_info), "attn": model.config._attn_implementation, "reloaded": reloaded,
                 "top_level": (_error(lambda: lf.AutoModelForImageTextToText.from_pretrained(c["vl"], use_cache=False)),
                               _error(lambda: tf.AutoModelForImageTextToText.from_pretrained(c["vl"],
                                                                                             use_cache=False)))}

    # config= an object, a path; keywords besides an object are refused by both
    cfg = tf.AutoConfig.from_pretrained(c["cfg"])
    out["config_object"] = (load(c["plain"], config=cfg).config.to_dict(),
                            Ref.from_pretrained(c["plain"], config=cfg).config.to_dict())
    out["config_path"] = (load(c["plain"], config=c["cfg"]).config.to_dict(),
                          tf.LlamaForCausalLM.from_pretrained(c["plain"], config=c["cfg"]).config.to_dict())
    out["config_object_extra"] = (_error(lambda: load(c["plain"], config=cfg, use_cache=False)),
                                  _error(lambda: Ref.from_pretrained(c["plain"], config=cfg, use_cache=False)))
    # unknown keywords, and config fields the architecture lacks
    out["unknown"] = {k: (_error(lambda: load(c["plain"], **{k: True})),
                          _error(lambda: Ref.from_pretrained(c["plain"], **{k: True})))
                      for k in ("foo", "output_router_logits")}

    # weight files: variant, use_safetensors (each moves the logits away from the plain safetensors')
    multi_plain = _logits(Ref.from_pretrained(c["multi"]))
    cases = {"variant": {"variant": "fp16"}, "use_safetensors": {"use_safetensors": False}}
    for name, kw in cases.items():
        mine = _logits(load(c["multi"], allow_pickle=True, device_map={"": "cpu"}, **kw))
        theirs = _logits(Ref.from_pretrained(c["multi"], **kw))
        out[name] = ((mine - theirs).abs().max().item(), (theirs - multi_plain).abs().max().item())
    out["safetensors_only"] = (_error(lambda: load(c["pickle_only"], allow_pickle=True, use_safetensors=True)),
                               _error(lambda: Ref.from_pretrained(c["pickle_only"], use_safetensors=True)))

    # subfolder of a hub repo (offline, from the local cache), and force_download, which needs the hub
    hub = {"cache_dir": c["hub"]}
    mine = _logits(load("org/tiny", subfolder="sub", **hub))
    theirs = _logits(Ref.from_pretrained("org/tiny", subfolder="sub", **hub))
    out["subfolder"] = ((mine - theirs).abs().max().item(), (theirs - _logits(Ref.from_pretrained("org/tiny", **hub)))
                        .abs().max().item(), (theirs - plain_ref).abs().max().item())
    out["force_download"] = (_error(lambda: load("org/tiny", force_download=True, **hub)),
                             _error(lambda: Ref.from_pretrained("org/tiny", force_download=True, **hub)))
    return out


REFUSED = {  # keyword(s) -> what the message must say
    "quantization_config": ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
                            "quantization_config: quantized loading is not supported"),
    "tp_plan": ({"tp_plan": "auto"}, "tp_plan: tensor parallelism is megatron-core's here"),
    "device_map_several": ({"device_map": {"model": "cpu", "lm_head": "disk"}}, "spreads the model over several"),
    "device_map_accelerator": ({"device_map": {"": 0}}, "places the model on accelerator 0"),
    "attn_implementation": ({"attn_implementation": "bogus"}, "attn_implementation='bogus' is not supported"),
    "output_hidden_states": ({"output_hidden_states": True}, "output_hidden_states=True is not supported"),
    "pickle": ({"use_safetensors": False}, "refused unless allow_pickle=True"),
    "unknown": ({"foo": 1}, "unexpected keyword arguments: ['foo']"),
}


def tp2_cases(c: dict) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM as Ref

    import loongforge_hf as lf

    load = lf.AutoModelForCausalLM.from_pretrained
    out = {}
    for name, (kw, _) in REFUSED.items():
        out[name] = (*_error(lambda: load(c["plain"], tensor_parallel_size=2, **kw)), dist.is_initialized())
    model = load(c["plain"], tensor_parallel_size=2, **OVERRIDES)
    out["override_diff"] = (_logits(model) - _logits(Ref.from_pretrained(c["plain"], **OVERRIDES))).abs().max().item()
    return out


# ---- tests -----------------------------------------------------------------------------------------------------------

def test_against_transformers_one_process(ckpts, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run_distributed(single_process_cases, 1, ckpts, env=CPU)[0]
    assert r["config_diff"] == {} and r["attn"] == ("eager", "eager"), r["config_diff"]
    assert r["info"][0] == r["info"][1]
    assert r["override_diff"] < TOL and r["override_moves"] > 10 * TOL, r
    for name, (mine, theirs) in r["saved"].items():
        assert mine == theirs, (name, mine, theirs)
    assert r["saved"]["config.json"][0]["max_position_embeddings"] == 256
    assert r["saved"]["generation_config.json"][0]["max_new_tokens"] == 7
    moe = r["moe"]
    assert moe["config_equal"] and moe["aux"] > 0 and moe["loss_diff"] < 1e-5 and moe["aux_diff"] < 1e-5, moe
    for mine, theirs in (r["config_object"], r["config_path"]):
        assert mine == theirs and mine["max_position_embeddings"] == 512, (mine, theirs)
    for pair in (r["config_object_extra"], *r["unknown"].values()):
        assert pair[0][0] == pair[1][0] == "TypeError", pair
    assert "['use_cache']" in r["config_object_extra"][0][1] and "['foo']" in r["unknown"]["foo"][0][1]
    for name in ("variant", "use_safetensors"):
        diff, moved = r[name]
        assert diff < TOL and moved > 10 * TOL, (name, r[name])
    (kind, message), (ref_kind, _) = r["safetensors_only"]
    assert kind == "CheckpointError" and "use_safetensors=True" in message and ref_kind == "OSError"
    diff, vs_top, vs_plain = r["subfolder"]
    assert diff < TOL and vs_top > 10 * TOL and vs_plain == 0.0, r["subfolder"]
    vl = r["vl"]
    mine, theirs = vl["text"]
    assert _no_dtype(mine) == _no_dtype(theirs), (mine, theirs)
    assert mine["use_cache"] is False and mine["max_position_embeddings"] == 512
    assert vl["info"][0] == vl["info"][1] and vl["attn"] == "sdpa"
    assert vl["reloaded"][0] == vl["reloaded"][1] and vl["reloaded"][0]["text_config"]["use_cache"] is False, vl
    assert vl["top_level"][0][0] == vl["top_level"][1][0] == "TypeError", vl["top_level"]
    (kind, message), (ref_kind, ref_message) = r["force_download"]
    assert kind == "CheckpointError" and "force_download=True needs the hub" in message, message
    assert ref_kind == "OSError" and "force_download" in ref_message


def test_refused_alike_on_every_rank_before_any_collective(ckpts):
    ranks = run_distributed(tp2_cases, 2, ckpts, env=CPU)
    for name, (kw, expected) in REFUSED.items():
        outcomes = [r[name] for r in ranks]
        assert outcomes[0] == outcomes[1], (name, outcomes)
        kind, message, collective_started = outcomes[0]
        assert kind == ("TypeError" if name == "unknown" else "ValueError") and expected in message, (name, message)
        assert not collective_started, name
    assert all(r["override_diff"] < TOL for r in ranks), [r["override_diff"] for r in ranks]


def test_multimodal_refuses_alike():
    """The vision-language model sorts the same keywords first (nothing is read)."""
    import loongforge_hf as lf

    with pytest.raises(ValueError, match="tp_plan: tensor parallelism is megatron-core's here"):
        lf.AutoModelForImageTextToText.from_pretrained("/nonexistent/vl", tp_plan="auto")


def _merged_expert_name(name: str) -> str:
    import re

    merged = re.sub(r"\.experts\.\d+\.(\w+)\.weight$", r".experts.\1", name)
    return re.sub(r"\.experts\.(gate|up)_proj$", ".experts.gate_up_proj", merged)


def loading_info_cases(folders: dict) -> dict:
    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    out = {}
    for name, folder in folders.items():
        _, info = lf.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        _, ref_info = hf_causal_lm(folder, output_loading_info=True)  # NOTE: by class where Auto does not map
        out[name] = (info, ref_info)
    return out


def test_loading_info_matches_transformers_on_every_architecture(tmp_path):
    """``output_loading_info`` of every tiny architecture equals transformers' (nothing missing, and the same
    unexpected keys), with a DeepSeek-V3 checkpoint that carries multi-token-prediction layers transformers skips, an
    ERNIE 4.5 MoE one and a MiMo-V2-Flash one whose multi-token-prediction tensors transformers ignores, a GPT-J one
    with older checkpoints' attention buffers (ignored too) and a checkpoint with a tensor no model reads."""
    from loongforge_hf.testing.tiny_models import TINY_ARCHS

    folders = {arch: str(make_tiny_checkpoint(tmp_path / arch, arch, tokenizer=False)) for arch in TINY_ARCHS}
    folders["deepseek_v3_mtp"] = str(make_tiny_checkpoint(tmp_path / "mtp", "deepseek_v3", tokenizer=False,
                                                          mtp_layers=1))
    # NOTE: transformers' ERNIE 4.5 MoE ignores its hub checkpoints' model.mtp_* tensors (not unexpected there)
    folders["ernie4_5_moe_mtp"] = str(make_tiny_checkpoint(tmp_path / "ernie_mtp", "ernie4_5_moe", tokenizer=False,
                                                           mtp_layers=1))
    # NOTE: and MiMo-V2-Flash its model.mtp.* tensors (_keys_to_ignore_on_load_unexpected)
    folders["mimo_v2_flash_mtp"] = str(make_tiny_checkpoint(tmp_path / "mimo_mtp", "mimo_v2_flash", tokenizer=False,
                                                            mtp_layers=1))
    extra = make_tiny_checkpoint(tmp_path / "extra", "qwen3", tokenizer=False, max_shard_size="10GB")
    from safetensors.torch import load_file, save_file

    weights = load_file(extra / "model.safetensors")
    save_file({**weights, "model.unused_probe.weight": torch.ones(3)}, extra / "model.safetensors",
              metadata={"format": "pt"})
    folders["qwen3_extra_tensor"] = str(extra)
    # NOTE: older GPT-J checkpoints' attention buffers, which transformers ignores (_keys_to_ignore_on_load_unexpected)
    legacy = make_tiny_checkpoint(tmp_path / "gptj_legacy", "gptj", tokenizer=False, max_shard_size="10GB")
    weights = load_file(legacy / "model.safetensors")
    buffers = {f"transformer.h.{i}.attn.{n}": torch.ones(1) for i in range(4) for n in ("bias", "masked_bias")}
    save_file({**weights, **buffers}, legacy / "model.safetensors", metadata={"format": "pt"})
    folders["gptj_attention_buffers"] = str(legacy)
    results = run_distributed(loading_info_cases, 1, folders, env=CPU, timeout=300)[0]
    for name, (mine, theirs) in results.items():
        # NOTE: our names are the checkpoint's own; transformers 5 lists a per-expert tensor under the merged name
        # it converts it to (experts.N.down_proj.weight -> experts.down_proj, gate/up -> gate_up_proj)
        mine = {**mine, "unexpected_keys": {_merged_expert_name(k) for k in mine["unexpected_keys"]}}
        assert mine == theirs, (name, mine, theirs)
    assert results["qwen3_extra_tensor"][0]["unexpected_keys"] == {"model.unused_probe.weight"}
