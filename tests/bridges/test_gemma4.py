"""Gemma 4's text model (Gemma4ForCausalLM): fp32 against transformers within 1e-4 on a tiny checkpoint shaped like
Gemma 4 31B's text model: a binding sliding window, full-attention layers with their own head size (32, the sliding
layers' 16) and KV heads (2, the sliding layers' 4) whose values are the key projection's output (attention_k_eq_v: no
v_proj), proportional rope on the full layers, v-norm, random ``layer_scalar`` buffers and a binding logit cap. One
one-rank world (TP1: logits, loss, ``logits_to_keep``, a bit-exact export, every gradient, greedy generate of a
left-padded batch past the window without a cache, with the dynamic one and with a static one; and a checkpoint whose
full layers have their own head size but values of their own, logits and loss) and one two-rank world (TP2 with sequence
parallelism, PP2: logits and loss, bit-exact exports; TP2's gradients). The 26B-A4B's MoE block (a dense MLP beside 8
routed experts, top 2, ``gemma4_moe``; the experts loongforge's ``GroupedMLP`` with the gated tanh-GELU) in the same
worlds: TP1, EP2 and TP2 + SP x EP2 (logits, loss, bit-exact exports; every gradient at the latter; transformers'
``router_logits`` and the experts' module type at TP1 and the latter). The refusals (config fields and layouts megatron
cannot reproduce) are checked on the bridge alone, as from_pretrained makes it before any collective. Gemma 4 as the hub
publishes it (Gemma4ForConditionalGeneration): tests/multimodal/test_gemma4_vl.py.

E2B / E4B's text model (``SMALL``: per-layer inputs, the last two layers reusing layers 0 and 1's keys and values,
double-wide MLPs there) in the same worlds: TP1 (logits, loss, a bit-exact export with every per-layer tensor, every
gradient, greedy generate uncached / with the dynamic cache / with a static one) and TP2 + SP (logits, loss, export; the
per-layer table vocab-split with a padding row) and CP2 (logits, loss, export, every gradient). Pipelines on an 8-layer
variant (``EIGHT``: the last layer reusing layer 6's keys and values) in the two-rank world: PP2 (logits, loss, a
bit-exact export, greedy generate uncached / cached / static) and PP2 x VPP2 (logits, loss, the training engine's step
with every gradient against transformers'), the stage boundaries carrying the per-layer inputs; ``EIGHT`` with layers 6,
7 reusing layer 3's keys and values (``SHARED_FROM_3``), which megatron's 4 / 4 would part, at PP2 on the bridge's 3 / 5
split and on a user's 2 / 6 (``megatron_config``): logits and loss, a bit-exact export; the image-text model with
per-layer inputs at PP2 on images (logits, loss, export). Its refusals (a pipeline split parting a reusing layer from
the layer storing its keys and values, LoRA on the per-layer linears) and ``parallel="auto"`` skipping layouts a bridge
refuses are checked on the bridge alone.

LoRA in the same worlds (``_lora_moe.moe_model_checks`` against PEFT on transformers' model, same initial values), at
TP1 and TP2 + SP (experts whole: expert_tensor_parallel_size=1): ``"all-linear"`` on the dense model (q / k / v in each
layer type's slots of ``linear_qkv``, the full layers without ``v_proj``, o and the MLP) and, on the MoE model,
``"all-linear"`` (the router's ``router.proj`` included: its adapter reads the router's transformed input, refused
before) plus the expert stacks as ``target_parameters`` (PEFT 0.21 has no rewrite for Gemma 4). Logits 1e-4 (1e-5
with experts), loss 1e-5, every adapter gradient of layers 1-2 (a full and a sliding layer) and the experts' and
router's of layer 1, PEFT's counts, megatron's DDP buffers, the adapter folder in PEFT, the
merged export in transformers and a PEFT-written adapter loaded. Gradients within 2e-4 (dense) and 1e-3 (MoE) of each
gradient's largest entry: these low-rank projections are ill-conditioned on the tiny checkpoint (binding logit cap,
routing), PEFT's own fp32 gradients being 2.1e-5 (dense) and 1.6e-4 (MoE) off its fp64 ones (measured at TP1, where ours
are 2.1e-5 and 5.2e-4 off those; at TP2 the summation order alone moves the dense ones by 2.5e-5)."""

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.round_trip import check_round_trip

TOL = 1e-4
LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}, "pp2": {"pipeline_parallel_size": 2}}
# NOTE: the MoE block (26B-A4B's text model) in the same worlds: TP1, TP2 + SP x EP2 (experts whole), EP2
MOE_LAYOUTS = {"moe_tp2_sp_ep2": {**LAYOUTS["tp2_sp"], "expert_parallel_size": 2, "expert_tensor_parallel_size": 1},
               "moe_ep2": {"expert_parallel_size": 2}}
# LoRA (module docstring): LoraConfig kwargs and the gradient tolerance (of each gradient's largest entry)
LORA = {"dense": (dict(r=2, lora_alpha=6, target_modules="all-linear", init_lora_weights=False), 2e-4),
        "moe": (dict(r=2, lora_alpha=6, target_modules="all-linear", init_lora_weights=False,
                     target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
                1e-3)}
LORA_TP2 = {**LAYOUTS["tp2_sp"], "expert_tensor_parallel_size": 1}
CP2 = {"context_parallel_size": 2}
# NOTE: Gemma 4 E2B / E4B's text model shrunk: per-layer inputs of 8 (a table of 203 rows: padded to 204 under TP2),
# the last two layers (a sliding and a full one) reusing layers 0 and 1's keys and values with double-wide MLPs, the
# full layers with KV heads of their own (no attention_k_eq_v)
SMALL = dict(attention_k_eq_v=False, hidden_size_per_layer_input=8, vocab_size_per_layer_input=203,
             num_kv_shared_layers=2, use_double_wide_mlp=True)
# NOTE: SMALL on 8 layers for pipelines: the last (full) layer reusing layer 6's keys and values with a double-wide
# MLP, so PP2's split 4 / 4 and PP2 x VPP2's 2 / 2 / 2 / 2 keep the pair on one stage
S, F = "sliding_attention", "full_attention"
EIGHT = dict(SMALL, num_kv_shared_layers=1, num_hidden_layers=8, layer_types=[S, F, S, F, S, S, F, F],
             per_layer_config={i: {"head_dim": 32, "num_key_value_heads": 2} for i in (1, 3, 6, 7)})
# NOTE: EIGHT with layers 6, 7 (full) reusing layer 3's keys and values: megatron's PP2 split 4 / 4 parts them
SHARED_FROM_3 = dict(EIGHT, num_kv_shared_layers=2)
FIRST, LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"


def _lora(folders: dict, adapters: dict, out_dir: str, layout: dict) -> dict:
    from ..integrations._lora_moe import moe_model_checks

    return {name: moe_model_checks(folders[name], f"{out_dir}/lora-{name}", layout, adapters[name], kw,
                                   grad_scale_tol=tol) for name, (kw, tol) in LORA.items()}


def _generate(folder: str, **layout) -> dict:
    import transformers

    import loongforge_hf as lf

    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(4, 203, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = {}
    for name, extra in (("uncached", {"use_cache": False}), ("cached", {}),
                        ("static", {"cache_implementation": "static"})):
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
        got, want = ours.generate(**kw, **extra), ref.generate(**kw, use_cache=extra.get("use_cache", True))
        out[name] = (torch.equal(got.sequences, want.sequences),
                     max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    return out


def _recompute_refusal(folder: str) -> str:
    """The message of a training forward with activation checkpointing on the E2B / E4B-like model."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    model.gradient_checkpointing_enable()
    try:
        model(input_ids=torch.arange(4, 12)[None], labels=torch.arange(4, 12)[None])
    except ValueError as err:
        return str(err)
    return "no error"


def _router_logits(folder: str, layout: dict) -> tuple[int, int, float, list[str]]:
    """(our count of MoE layers' router outputs, transformers', the largest difference, our experts' module types)."""
    import transformers

    import loongforge_hf as lf

    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(4, 203, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = (m(input_ids=ids, output_router_logits=True).router_logits for m in (ours, ref))
    experts = sorted({type(m).__name__ for chunk in ours.megatron.chunks for n, m in chunk.named_modules()
                      if n.endswith("mlp.experts")})
    return len(got), len(want), max(float((a - b).abs().max()) for a, b in zip(got, want)), experts


def _one_rank(folder: str, out_dir: str, own_values: str, moe: str, adapters: dict, small: str) -> dict:
    from ._gradients import gradient_checks
    from ._parity import load_compare_export

    return {"tp1": load_compare_export(folder, {}, out_dir, seq=12, padded=True), **_generate(folder),
            "small_tp1": load_compare_export(small, {}, f"{out_dir}-small", seq=12, padded=True),
            "small_generate": _generate(small), "small_grads": gradient_checks([("tp1", small, {}, True)]).get("tp1"),
            "small_recompute": _recompute_refusal(small),
            "grads": gradient_checks([("tp1", folder, {}, True)]).get("tp1"),
            "own_values": load_compare_export(own_values, {}, f"{out_dir}-own-values", seq=12, padded=True),
            "moe_tp1": load_compare_export(moe, {}, f"{out_dir}-moe", seq=12, padded=True),
            "router_logits": _router_logits(moe, {}),
            "lora": _lora({"dense": folder, "moe": moe}, adapters, f"{out_dir}-lora", {})}


def _small_pipelines(eight: str, vl_small: str, out_dirs: dict, shared_from_3: str) -> dict:
    """``EIGHT`` at PP2 (logits, loss, export, greedy generate as ``_generate``) and at PP2 x VPP2 (logits, loss, and
    the training engine's step: megatron's interleaved schedule over two micro-batches, every gradient exported
    through the bridge); the image-text model with per-layer inputs at PP2 on a batch with images (logits, loss,
    export); ``SHARED_FROM_3`` at PP2 on the bridge's split and on a user's (logits, loss, export; the layers each
    stage holds; a user's split that parts them refused)."""
    from loongforge_hf.bridges import UnsupportedConfigError

    from ..multimodal._vl_gemma4 import compare_images
    from ._parity import load_compare_export
    from .test_gemma3n import _engine_gradients, _models
    from .test_recurrent_gemma import _plain

    pp2 = {"pipeline_parallel_size": 2}
    out = {"small_pp2": load_compare_export(eight, pp2, out_dirs["small_pp2"], seq=12, padded=True),
           "small_pp2_generate": _generate(eight, **pp2),
           "vl_small_pp2": compare_images(vl_small, pp2, out_dirs["vl_small_pp2"])}
    ours, ref = _models(eight, pipeline_parallel_size=2, virtual_pipeline_parallel_size=2)
    out["small_pp2_vpp2"] = {"plain": _plain(ours, ref), "grads": _engine_gradients(ours, ref, eight)}
    for name, layout in (("split_pp2", pp2), ("user_split_pp2", {**pp2, "megatron_config": {FIRST: 2}})):
        ours, ref = _models(shared_from_3, **layout)
        out[name] = {"plain": _plain(ours, ref), "layers": ours.megatron.layer_counts}  # NOTE: rank 0's: the first
        ours.save_pretrained(out_dirs[name])
        del ours
    try:  # NOTE: refused on every rank before any collective (no hang)
        _models(shared_from_3, **pp2, megatron_config={FIRST: 5})
    except UnsupportedConfigError as err:
        out["user_split_refused"] = str(err)
    return out


def _two_ranks(folder: str, out_dirs: dict, moe: str, adapters: dict, small: str, eight: str, vl_small: str,
               shared_from_3: str) -> dict:
    from ._gradients import gradient_checks
    from ._parity import load_compare_export

    moe_layout = MOE_LAYOUTS["moe_tp2_sp_ep2"]
    return {**{name: load_compare_export(folder, layout, out_dirs[name], seq=12, padded=True)
               for name, layout in LAYOUTS.items()},
            **{name: load_compare_export(moe, layout, out_dirs[name], seq=12, padded=True)
               for name, layout in MOE_LAYOUTS.items()},
            "grads": gradient_checks([("tp2_sp", folder, LAYOUTS["tp2_sp"], True)]).get("tp2_sp"),
            "moe_grads": gradient_checks([("tp2_sp_ep2", moe, moe_layout, True)]).get("tp2_sp_ep2"),
            "router_logits": _router_logits(moe, moe_layout),
            "lora": _lora({"dense": folder, "moe": moe}, adapters, out_dirs["lora"], LORA_TP2),
            "small_tp2_sp": load_compare_export(small, LAYOUTS["tp2_sp"], out_dirs["small_tp2_sp"], seq=12,
                                                padded=True),
            "small_cp2": load_compare_export(small, CP2, out_dirs["small_cp2"], seq=12, padded=True),
            "small_cp2_grads": gradient_checks([("cp2", small, CP2, True)]).get("cp2"),
            **_small_pipelines(eight, vl_small, out_dirs, shared_from_3)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma4") / "ckpt", "gemma4"))


@pytest.fixture(scope="module")
def own_values(tmp_path_factory):  # NOTE: without attention_k_eq_v transformers keeps the full layers' KV heads
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma4_v") / "ckpt", "gemma4", attention_k_eq_v=False))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma4_moe") / "ckpt", "gemma4_moe"))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma4_small") / "ckpt", "gemma4", **SMALL))


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma4_eight") / "ckpt", "gemma4", **EIGHT))


@pytest.fixture(scope="module")
def shared_from_3(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma4_shared3") / "ckpt", "gemma4", **SHARED_FROM_3))


@pytest.fixture(scope="module")
def vl_small(tmp_path_factory):
    """The image-text model over ``SMALL`` without shared keys and values (its 2 / 2 split would part them) and
    without the double-wide MLPs (tests/multimodal/test_gemma4_vl.py's ``small`` says why)."""
    from loongforge_hf.testing.tiny_gemma4_vl import make_tiny_gemma4_vl

    return str(make_tiny_gemma4_vl(tmp_path_factory.mktemp("gemma4_vl_small_pp") / "src", audio=False,
                                   **{**SMALL, "num_kv_shared_layers": 0, "vocab_size_per_layer_input": 210,
                                      "use_double_wide_mlp": False}))


@pytest.fixture(scope="module")
def lora_adapters(folder, moe, tmp_path_factory):
    """A PEFT-written adapter (random factors) of each LoRA case."""
    from ..integrations._lora_load import write_peft_adapter

    base, adapters = tmp_path_factory.mktemp("gemma4_lora"), {}
    for name, checkpoint in (("dense", folder), ("moe", moe)):
        adapters[name] = str(base / name)
        write_peft_adapter(checkpoint, adapters[name], LORA[name][0])
    return adapters


@pytest.fixture(scope="module")
def one_rank(folder, own_values, moe, lora_adapters, small, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("gemma4_tp1"))
    return {**run_distributed(_one_rank, 1, folder, out_dir, own_values, moe, lora_adapters, small, timeout=500)[0],
            "out_dir": out_dir}


@pytest.fixture(scope="module")
def two_ranks(folder, moe, lora_adapters, small, eight, vl_small, shared_from_3, tmp_path_factory):
    out_dirs = {name: str(tmp_path_factory.mktemp(f"gemma4_{name}"))
                for name in (*LAYOUTS, *MOE_LAYOUTS, "lora", "small_tp2_sp", "small_cp2", "small_pp2", "vl_small_pp2",
                             "split_pp2", "user_split_pp2")}
    return {**run_distributed(_two_ranks, 2, folder, out_dirs, moe, lora_adapters, small, eight, vl_small,
                              shared_from_3, timeout=500)[0], "out_dirs": out_dirs}


def test_tp1_logits_loss_and_export(one_rank, folder):
    r = one_rank["tp1"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL, r
    assert r["grads_ok"] and r["keep"][1] < TOL, r
    check_round_trip(folder, one_rank["out_dir"])


@pytest.mark.parametrize("world", ["one_rank", "two_ranks"])
def test_gradients(world, request):
    grads = request.getfixturevalue(world)["grads"]
    assert not grads["missing"], grads["missing"]
    assert grads["diffs"] and max(grads["diffs"].values()) < TOL, grads["diffs"]
    assert "model.layers.1.self_attn.k_proj.weight" in grads["diffs"], sorted(grads["diffs"])


def test_full_layers_with_values_of_their_own(one_rank, own_values):
    r = one_rank["own_values"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL, r
    check_round_trip(own_values, f"{one_rank['out_dir']}-own-values")


@pytest.mark.parametrize("mode", ["uncached", "cached", "static"])
def test_greedy_generate_left_padded(one_rank, mode):
    same, score_diff = one_rank[mode]
    assert same and score_diff < TOL, one_rank[mode]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts(two_ranks, folder, layout):
    r = two_ranks[layout]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL, r
    check_round_trip(folder, two_ranks["out_dirs"][layout])


@pytest.mark.parametrize("world, key", [("one_rank", "small_tp1"), ("two_ranks", "small_tp2_sp"),
                                        ("two_ranks", "small_cp2")])
def test_small_model_logits_loss_and_export(world, key, small, request):
    """E2B / E4B's per-layer inputs, shared KV and double-wide MLPs (``SMALL``) at TP1, TP2 + SP (the per-layer
    table vocab-split with a padding row) and CP2 (each rank's stream its own tokens', the reused keys and values
    gathered over the CP group by the reusing layers): logits, loss, bit-exact exports (every per-layer tensor)."""
    res = request.getfixturevalue(world)
    r = res[key]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL, r
    out = f"{res['out_dir']}-small" if world == "one_rank" else res["out_dirs"][key]
    check_round_trip(small, out)


def test_small_model_gradients_at_cp2(two_ranks):
    """Every gradient at CP2 (pad ids among the tokens), the per-layer table's and the reused keys' included."""
    grads = two_ranks["small_cp2_grads"]
    assert not grads["missing"], grads["missing"]
    assert grads["diffs"] and max(grads["diffs"].values()) < TOL, grads["diffs"]
    assert {"model.embed_tokens_per_layer.weight", "model.layers.1.self_attn.k_proj.weight"} <= set(grads["diffs"])


def test_small_model_gradients_and_cached_generate(one_rank):
    """Every gradient (the per-layer table, projection, norms, gates; the storing layers' k / v with the reusing
    layers' share) and greedy generate of a left-padded batch without a cache, with the dynamic and a static one;
    a training forward with activation checkpointing refused by name."""
    grads = one_rank["small_grads"]
    assert not grads["missing"], grads["missing"]
    assert grads["diffs"] and max(grads["diffs"].values()) < TOL, grads["diffs"]
    want = {"model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
            "model.per_layer_projection_norm.weight", "model.layers.3.per_layer_input_gate.weight",
            "model.layers.3.per_layer_projection.weight", "model.layers.3.post_per_layer_input_norm.weight",
            "model.layers.1.self_attn.k_proj.weight", "model.layers.3.mlp.up_proj.weight"}
    assert want <= set(grads["diffs"]), sorted(want - set(grads["diffs"]))
    for mode, (same, score_diff) in one_rank["small_generate"].items():
        assert same and score_diff < TOL, (mode, same, score_diff)
    assert "activation checkpointing" in one_rank["small_recompute"], one_rank["small_recompute"]
    assert "hidden_size_per_layer_input=8" in one_rank["small_recompute"], one_rank["small_recompute"]


def test_small_model_pipelines(two_ranks, eight):
    """``EIGHT`` at PP2 (logits, loss, a bit-exact export, greedy generate of a left-padded batch uncached / with the
    dynamic cache / with a static one: the reusing layer reads the storing layer's cache on its stage) and PP2 x
    VPP2 (logits, loss; the engine's step with every gradient against transformers', the first stage's per-layer
    table / projection / norm and the last stage's reusing layer and the layer storing its keys and values among
    them): the stage boundaries carry the per-layer inputs."""
    r = two_ranks["small_pp2"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["keep"][1] < TOL, r
    check_round_trip(eight, two_ranks["out_dirs"]["small_pp2"])
    for mode, (same, score_diff) in two_ranks["small_pp2_generate"].items():
        assert same and score_diff < TOL, (mode, same, score_diff)
    r = two_ranks["small_pp2_vpp2"]
    assert r["plain"]["logits"] < TOL and r["plain"]["loss"] < TOL, r["plain"]
    grads = r["grads"]
    want = {"model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
            "model.per_layer_projection_norm.weight", "model.layers.7.per_layer_input_gate.weight",
            "model.layers.7.mlp.up_proj.weight", "model.layers.6.self_attn.k_proj.weight",
            "model.layers.7.self_attn.q_proj.weight", "model.layers.0.per_layer_projection.weight"}
    assert want <= set(grads), sorted(want - set(grads))
    assert len(grads) > 100 and max(grads.values()) < TOL, sorted(grads.items(), key=lambda kv: -kv[1])[:5]


def test_image_text_model_pipeline_with_per_layer_inputs(two_ranks, vl_small):
    """Gemma4ForConditionalGeneration with per-layer inputs at PP2 on a batch with images (the vision tower and the
    per-layer table on the first stage, image placeholders looked up as padding there): logits, loss, a bit-exact
    export of the whole folder."""
    r = two_ranks["vl_small_pp2"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["blocks_matter"] > 1e-2, r
    check_round_trip(vl_small, two_ranks["out_dirs"]["vl_small_pp2"])


def test_pipeline_split_keeps_shared_keys_and_values_together(two_ranks, shared_from_3):
    """``SHARED_FROM_3`` at PP2: megatron's 4 / 4 would part layers 6, 7 from layer 3, so the bridge builds 3 / 5; a
    user's ``num_layers_in_first_pipeline_stage=2`` (2 / 6) is taken as given, its 5 (5 / 3) refused by name on every
    rank before any collective. Logits and loss within 1e-4 of transformers', bit-exact exports."""
    for name, first_stage in (("split_pp2", [3]), ("user_split_pp2", [2])):
        r = two_ranks[name]
        assert r["plain"]["logits"] < TOL and r["plain"]["loss"] < TOL, (name, r)
        assert r["layers"] == first_stage, (name, r["layers"])
        check_round_trip(shared_from_3, two_ranks["out_dirs"][name])
    assert "megatron_config {'num_layers_in_first_pipeline_stage': 5} (stages of [5, 3] layers) is not supported " \
           "for Gemma4ForCausalLM: layers [6, 7] reuse" in two_ranks.get("user_split_refused", "not refused")


def test_pipeline_splits_keep_shared_keys_on_one_stage():
    """Where megatron's split parts a layer reusing keys and values from the layer storing them, the bridge picks
    the most even split that does not (``stage_boundary.pipeline_split``); refused by name (pure, before any
    collective): virtual stages (split evenly) that part them, a pipeline size no split of which keeps them
    together, a user's first / last stage size that parts them or that megatron cannot take, and one with virtual
    stages. Other bridges still refuse those ``megatron_config`` fields."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.builder import check_megatron_config
    from loongforge_hf.bridges.stage_boundary import pipeline_split
    from loongforge_hf.parallel.config import ParallelConfig, ParallelLayoutError
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("gemma4", **EIGHT))
    assert bridge.pipeline_hidden_size() == 64 + 8 * 8 and bridge.wide_layers == {7}
    for layout in (dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2, virtual_pipeline_parallel_size=2),
                   dict(pipeline_parallel_size=4)):
        bridge.check_layout(ParallelConfig(**layout))
    for changes, layout, message in (
            ({}, dict(pipeline_parallel_size=2, virtual_pipeline_parallel_size=4),
             "pipeline_parallel_size=2 with virtual_pipeline_parallel_size=4 is not supported for Gemma4ForCausalLM: "
             "layers [7] reuse the keys and values of layers [6] on another pipeline stage (num_kv_shared_layers=1"),
            ({"num_kv_shared_layers": 2}, dict(pipeline_parallel_size=5),
             "pipeline_parallel_size=5 is not supported for Gemma4ForCausalLM: layers [6, 7] reuse the keys and "
             "values of layers [3] on another pipeline stage (num_kv_shared_layers=2; the shared keys and values do "
             "not cross stages); no split of the 8 layers over 5 stages")):
        with pytest.raises(UnsupportedConfigError, match=re.escape(message)):
            get_bridge(_config("gemma4", **{**EIGHT, **changes})).check_layout(ParallelConfig(**layout))
    shared = get_bridge(_config("gemma4", **SHARED_FROM_3))
    pp2, pp4 = ParallelConfig(pipeline_parallel_size=2), ParallelConfig(pipeline_parallel_size=4)
    shared.check_layout(pp2)
    assert pipeline_split(shared, pp2) == {LAST: 5} and pipeline_split(bridge, pp2) == {}
    assert pipeline_split(shared, pp4) == {LAST: 5}  # NOTE: 1 / 1 / 1 / 5
    assert pipeline_split(shared, pp2, {FIRST: 2, "seq_length": 12}) == {FIRST: 2}
    check_megatron_config(shared, {FIRST: 2})
    for config, layout, error, message in (
            ({FIRST: 5}, pp2, UnsupportedConfigError, "megatron_config {'num_layers_in_first_pipeline_stage': 5} "
             "(stages of [5, 3] layers) is not supported for Gemma4ForCausalLM: layers [6, 7] reuse the keys and "
             "values of layers [3] on another pipeline stage"),
            ({FIRST: 3}, pp4, ParallelLayoutError, "megatron cannot split num_hidden_layers=8 over "
             "pipeline_parallel_size=4 so"),
            ({FIRST: 4}, ParallelConfig(pipeline_parallel_size=2, virtual_pipeline_parallel_size=2),
             UnsupportedConfigError, "with virtual_pipeline_parallel_size=2 is not supported for Gemma4ForCausalLM: "
             "virtual pipeline stages split the layers evenly")):
        with pytest.raises(error, match=re.escape(message)):
            pipeline_split(shared, layout, config)
    with pytest.raises(ValueError, match=f"{FIRST}: set from the checkpoint's config or the layout"):
        check_megatron_config(get_bridge(_config("gemma")), {FIRST: 2})


def test_small_model_refusals_name_the_field():
    """A pipeline split between the layers sharing keys and values (``SMALL``'s 2 / 2: layers 2, 3 reuse layers 0
    and 1's), CP with per-layer inputs / shared KV, all layers sharing, the MoE block with them; LoRA's
    ``"all-linear"`` refused naming the model's ``per_layer_model_projection`` for exclude_modules (each layer's
    per-layer linears are targets); the bridge builds them right away."""
    import peft

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora
    from loongforge_hf.parallel.config import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("gemma4", **SMALL))
    assert bridge.reusing_layers == bridge.wide_layers == {2, 3}
    with pytest.raises(UnsupportedConfigError, match=re.escape("pipeline_parallel_size=2 is not supported for "
                                                               "Gemma4ForCausalLM: layers [2, 3] reuse the keys and "
                                                               "values of layers [0, 1] on another pipeline stage")):
        bridge.check_layout(ParallelConfig(pipeline_parallel_size=2))
    bridge.check_layout(ParallelConfig(context_parallel_size=2))  # NOTE: runs (test_small_model_gradients_at_cp2)
    with pytest.raises(UnsupportedConfigError, match="num_kv_shared_layers=2"):
        get_bridge(_config("gemma4", num_kv_shared_layers=2)).check_layout(ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(UnsupportedConfigError, match="num_kv_shared_layers=4"):
        get_bridge(_config("gemma4", num_kv_shared_layers=4))
    with pytest.raises(UnsupportedConfigError, match="enable_moe_block"):
        get_bridge(_config("gemma4_moe", hidden_size_per_layer_input=8))
    # NOTE: each layer's per-layer linears are targets (lora/replicated.py; against PEFT in test_lora_new_bridges),
    # the model's per_layer_model_projection outside the layers is not
    with pytest.raises(LoraConfigError, match=r"per_layer_model_projection.*exclude_modules=\['per_layer_model_pro"):
        plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear"))
    plan = plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear",
                                             exclude_modules=["per_layer_model_projection"]))
    assert {(t.name, t.kind) for t in plan.targets if "per_layer" in t.name} == {
        ("per_layer_input_gate", "replicated"), ("per_layer_projection", "replicated")}


def test_moe_block_tp1(one_rank, moe):
    r = one_rank["moe_tp1"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL, r
    assert r["grads_ok"] and r["keep"][1] < TOL, r
    check_round_trip(moe, f"{one_rank['out_dir']}-moe")


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_block_expert_parallel(two_ranks, moe, layout):
    r = two_ranks[layout]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["grads_ok"], r
    check_round_trip(moe, two_ranks["out_dirs"][layout])


def test_moe_block_gradients(two_ranks):
    grads = two_ranks["moe_grads"]
    assert not grads["missing"], grads["missing"]
    assert grads["diffs"] and max(grads["diffs"].values()) < TOL, grads["diffs"]
    moe = ("experts.gate_up_proj", "experts.down_proj", "router.proj.weight", "router.scale",
           "router.per_expert_scale", "mlp.gate_proj.weight", "pre_feedforward_layernorm_2.weight",
           "post_feedforward_layernorm_1.weight", "post_feedforward_layernorm_2.weight")
    assert all(f"model.layers.1.{name}" in grads["diffs"] for name in moe), sorted(grads["diffs"])


@pytest.mark.parametrize("world", ["one_rank", "two_ranks"])
def test_moe_router_logits_and_grouped_experts(world, request):
    ours, theirs, diff, experts = request.getfixturevalue(world)["router_logits"]
    assert ours == theirs == 4 and diff < TOL, (ours, theirs, diff)
    assert experts == ["GroupedMLP"], experts  # the parity checks above ran through the grouped experts


@pytest.mark.parametrize("name", list(LORA))
@pytest.mark.parametrize("world", ["one_rank", "two_ranks"])
def test_lora_matches_peft(world, name, request):
    """LoRA against PEFT (module docstring); q / k / v adapted in both layer types, no v_proj on the full layers."""
    from ..integrations.test_lora_moe import _assert_model_matches_peft

    res = request.getfixturevalue(world)["lora"][name]
    _assert_model_matches_peft([res], experts=name == "moe")


def test_lora_plan_per_layer_type_and_router():
    """q / k / v of each layer type at its own heads (sliding: 8 x 16 queries, 4 x 16 keys and values; full: 8 x 32
    queries, 2 x 32 keys, no v_proj); the MoE model's router.proj a router target (with lora_dropout refused naming
    exclude_modules), its experts planned."""
    import peft

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora
    from loongforge_hf.testing.tiny_models import _config

    plan = plan_lora(get_bridge(_config("gemma4")), peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj"]))
    rows = {(t.layer, t.name): t.out_features for t in plan.targets if t.layer < 2}
    assert rows == {(0, "q_proj"): 128, (0, "k_proj"): 64, (0, "v_proj"): 64, (1, "q_proj"): 256, (1, "k_proj"): 64}
    with pytest.raises(LoraConfigError, match=r"router's linear \(\['proj'\]\).*exclude_modules=\['proj'\]"):
        plan_lora(get_bridge(_config("gemma4_moe")),
                  peft.LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.1))
    plan = plan_lora(get_bridge(_config("gemma4_moe")), peft.LoraConfig(**LORA["moe"][0]))
    assert {t.slot_name for t in plan.targets if t.kind == "experts"} == {"gate_up_proj", "down_proj"}
    assert {t.hf_module.rsplit(".", 2)[-2] for t in plan.targets if t.kind == "router"} == {"router"}


@pytest.mark.parametrize("field, value", [("num_experts", None), ("top_k_experts", 0), ("top_k_experts", 9),
                                          ("moe_intermediate_size", None)])
def test_moe_block_refusals_name_the_field(field, value):
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.gemma4_moe import Gemma4MoeBridge
    from loongforge_hf.testing.tiny_models import _config

    assert isinstance(get_bridge(_config("gemma4_moe")), Gemma4MoeBridge)
    with pytest.raises(UnsupportedConfigError, match=field):
        get_bridge(_config("gemma4_moe", **{field: value}))


@pytest.mark.parametrize("field, value, match", [
    ("use_bidirectional_attention", "all", None), ("attention_bias", True, None),
    ("per_layer_config", {1: {"head_dim": 32, "intermediate_size": 48}, 3: {"head_dim": 32}}, "intermediate_size"),
    ("per_layer_config", {1: {"head_dim": 32}, 3: {"head_dim": 64}}, "full_attention layers"),
])
def test_refusals_name_the_field(field, value, match):
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.testing.tiny_models import _config

    with pytest.raises(UnsupportedConfigError, match=match or field):
        get_bridge(_config("gemma4", **{field: value}))


@pytest.mark.parametrize("tp, field", [(4, "num_global_key_value_heads=2"), (8, "num_key_value_heads=4")])
def test_kv_heads_of_each_layer_type_split_over_tp(tp, field):
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel.config import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    with pytest.raises(UnsupportedConfigError, match=field):
        get_bridge(_config("gemma4")).check_layout(ParallelConfig(tensor_parallel_size=tp))


def test_angles_cut_once_per_forward_and_unused_kv_carried():
    """Each layer type's rotary angles are cut from the side-by-side table once per table (a forward's layers share
    the copy; a new table, a new cut), equal to the slice; a checkpoint's k / v / k norm of reusing layers (which
    transformers ignores) are carried through exports, nothing else."""
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.bridges.gemma4_attention import _AngleCache
    from loongforge_hf.testing.tiny_models import _config

    cache, table = _AngleCache(), torch.randn(7, 1, 1, 48)
    full, sliding = cache.get(table, 32, full=True), cache.get(table, 16, full=False)
    assert cache.get(table, 32, full=True) is full and cache.get((table, table), 16, full=False)[1] is sliding
    assert torch.equal(full, table[..., :32]) and torch.equal(sliding, table[..., 32:]) and full.is_contiguous()
    assert cache.get(table.clone(), 32, full=True) is not full
    names = [f"model.layers.{i}.self_attn.{n}.weight" for i in range(4) for n in ("k_proj", "v_proj", "k_norm")]
    carried = get_bridge(_config("gemma4", **SMALL)).passthrough_names(names + ["model.norm.weight"])
    assert carried == [n for n in names if n.startswith(("model.layers.2.", "model.layers.3."))], carried
    assert get_bridge(_config("gemma4")).passthrough_names(names) == []


def test_auto_layout_skips_what_the_bridge_refuses():
    """parallel="auto" asks the bridge (check_layout): TP4 fits but splits the full layers' 2 KV heads, so the planner
    goes on to TP2 x PP2; ``SMALL`` refuses PP2's split (its reusing layers 2, 3 on another stage than layers 0, 1),
    so there TP4 stays out and nothing else fits."""
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.parallel.auto import ModelSize, bridge_accepts, choose_layout
    from loongforge_hf.parallel.config import ParallelLayoutError
    from loongforge_hf.testing.tiny_models import _config

    size = ModelSize(num_params=10**9, num_layers=4, num_attention_heads=8, num_key_value_heads=4)
    kw = dict(world_size=4, local_world_size=4, device_memory=4.5e9 / 0.65)
    assert choose_layout(size, **kw)[0].tensor_parallel_size == 4
    layout, _ = choose_layout(size, **kw, accepts=bridge_accepts(get_bridge(_config("gemma4"))))
    assert (layout.tensor_parallel_size, layout.pipeline_parallel_size) == (2, 2)
    with pytest.raises(ParallelLayoutError):
        choose_layout(size, **kw, accepts=bridge_accepts(get_bridge(_config("gemma4", **SMALL))))


def test_refuses_proportional_factor_out_of_range():
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.testing.tiny_models import _config

    cfg = _config("gemma4")
    cfg.rope_parameters["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(UnsupportedConfigError, match="sliding_attention"):
        get_bridge(cfg)
