"""Gemma3nForCausalLM (Gemma 3n's text decoder) against transformers, fp32 within 1e-4, on a tiny model with every
piece bound (``testing/tiny_gemma3n.py``): 3 AltUp streams (the active one the second), LAuReL, per-layer inputs
from a table smaller than the vocabulary, the last 2 layers reusing keys and values, the Gaussian top-k on the
first 2 layers, per-layer MLP widths, sliding / full layers with their own rope, soft-capped logits.

One world of two ranks:
- TP1 (each rank alone): logits and loss, left padding against each row alone, packed documents against each
  document alone, cached greedy (dynamic and static cache) and beam search against transformers'; a
  bit-exact export round trip;
- TP2 + SP: logits and loss, left padding, every parameter's gradient exported through the bridge against
  transformers' (the top-k's mean and variance all-reduced over TP); CP2 the same (the reused keys and values
  gathered over the CP group by the reusing layers);
- PP2 on the 5-layer model, whose even-ish split 3 / 2 would part layers 3, 4 from layers 1, 2 (whose keys and
  values they reuse): the bridge's split 1 / 4 instead (``stage_boundary.pipeline_split``), logits and loss, cached
  greedy, a bit-exact export;
- pipelines, on an 8-layer variant (``EIGHT``: the last layer reusing the keys and values of the one before it, so
  PP2's split 4 / 4 and PP2 x VPP2's 2 / 2 / 2 / 2 keep them on one stage): at PP2 logits and loss, left padding,
  cached greedy, a bit-exact export; at PP2 x VPP2 logits and loss and the training engine's step (LoongTrainer's:
  megatron's interleaved schedule over two micro-batches, the stage boundaries carrying the AltUp streams and the
  per-layer inputs) with every gradient exported through the bridge against transformers';
- refusals on the bridge alone (pure, before any collective), naming the field."""

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .test_recurrent_gemma import _gradients, _ids, _padded, _plain

TOL = 1e-4
S, F = "sliding_attention", "full_attention"
EIGHT = dict(num_hidden_layers=8, layer_types=[S, S, F, S, S, F, S, S],
             intermediate_size=[96, 64, 96, 96, 64, 96, 64, 96],
             activation_sparsity_pattern=[0.95, 0.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], num_kv_shared_layers=1)


def _models(folder: str, **layout):
    import transformers

    import loongforge_hf as lf

    return (lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


def _generate(ours, ref) -> dict:
    """Cached greedy (our dynamic and static caches, the window passed) and 2-beam search against transformers'."""
    ids = _ids((2, 9), seed=3)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    want = ref.generate(input_ids=ids, **kw)
    runs = {"greedy": (ours.generate(input_ids=ids, **kw), want),
            "static": (ours.generate(input_ids=ids, cache_implementation="static", **kw), want),
            "beam": (ours.generate(input_ids=ids, num_beams=2, **kw),
                     ref.generate(input_ids=ids, num_beams=2, use_cache=False, **kw))}
    return {name: (torch.equal(got.sequences, theirs.sequences),
                   max(float((a - b).abs().max()) for a, b in zip(got.scores, theirs.scores)))
            for name, (got, theirs) in runs.items()}


def _engine_gradients(ours, ref, folder: str) -> dict | None:
    """The training engine's step (LoongTrainer's; two micro-batches of one row, as the interleaved schedule needs):
    every gradient of the mean loss, taken before the optimizer step (the engine's buffers hold the loss sum's) and
    exported through the bridge, against transformers' (rank 0: relative to each tensor's largest; None elsewhere)."""
    import tempfile

    import torch.distributed as dist
    import transformers

    from loongforge_hf.trainer.engine import MegatronEngine

    from ._gradients import gradient_diffs

    ids, grads = _ids((2, 24), seed=2), f"{folder}-pipeline-grads"

    def save() -> None:
        with torch.no_grad():
            for p in ours.parameters():
                p.copy_(p.main_grad / ids[:, 1:].numel())
        ours.save_pretrained(grads)

    with tempfile.TemporaryDirectory() as out:
        engine = MegatronEngine(ours, args=transformers.TrainingArguments(out, use_cpu=True, report_to=[]))
        engine.train_step([{"input_ids": row, "labels": row} for row in ids.split(1)], before_optimizer_step=save)
    if dist.get_rank() != 0:
        return None
    ref.zero_grad()
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return gradient_diffs(grads, ref)


def _greedy(ours, ref) -> tuple[bool, float]:
    ids = _ids((2, 9), seed=3)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    got, want = ours.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw)
    return torch.equal(got.sequences, want.sequences), max(float((a - b).abs().max())
                                                           for a, b in zip(got.scores, want.scores))


def _pipelines(folder: str) -> dict:
    """PP2 and PP2 x VPP2 on the 8-layer variant (module docstring)."""
    import loongforge_hf as lf

    ours, ref = _models(folder, pipeline_parallel_size=2)
    out = {"pp2": {"plain": _plain(ours, ref), "padded": _padded(ours, ref), "greedy": _greedy(ours, ref)}}
    out["pp2"]["round_trip"] = _round_trip(ours, folder, "saved")
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2,
                                                   virtual_pipeline_parallel_size=2)
    out["pp2_vpp2"] = {"plain": _plain(ours, ref), "grads": _engine_gradients(ours, ref, folder)}
    return out


def _round_trip(ours, folder: str, suffix: str) -> bool | None:
    """``ours`` saved to ``{folder}-{suffix}`` (every rank takes part; rank 0 writes) and, on rank 0, checked
    bit for bit against ``folder`` (``check_round_trip``): True there, None on the other ranks."""
    import torch.distributed as dist

    from loongforge_hf.testing.round_trip import check_round_trip

    ours.save_pretrained(f"{folder}-{suffix}")
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    check_round_trip(folder, f"{folder}-{suffix}")
    return True


def _world(folder: str, eight: str) -> dict:
    import loongforge_hf as lf

    from .test_qwen3_5 import packed_against_alone

    ours, ref = _models(folder, tensor_parallel_size=1)
    out = {"tp1": {"plain": _plain(ours, ref), "padded": _padded(ours, ref), "packed": packed_against_alone(ours, ref),
                   "generate": _generate(ours, ref)}}
    out["round_trip"] = _round_trip(ours, folder, "saved")
    del ours
    ours, ref = _models(folder, tensor_parallel_size=2, sequence_parallel=True)
    out["tp2"] = {"plain": _plain(ours, ref), "padded": _padded(ours, ref), "grads": _gradients(ours, ref, folder)}
    del ours
    ours, ref = _models(folder, context_parallel_size=2)
    out["cp2"] = {"plain": _plain(ours, ref), "padded": _padded(ours, ref), "grads": _gradients(ours, ref, folder)}
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2)
    out["pp2_split"] = {"plain": _plain(ours, ref), "greedy": _greedy(ours, ref), "layers": ours.megatron.layer_counts}
    out["pp2_split"]["round_trip"] = _round_trip(ours, folder, "pp2-saved")
    del ours
    return {**out, **_pipelines(eight)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3n") / "g", "gemma3n"))


@pytest.fixture(scope="module")
def world(folder, tmp_path_factory):
    eight = str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3n8") / "g", "gemma3n", **EIGHT))
    return run_distributed(_world, 2, folder, eight, timeout=300)


def test_tp1(world):
    for rank in world:
        res = rank["tp1"]
        for name in ("plain", "padded"):
            assert res[name]["logits"] < TOL and res[name]["loss"] < TOL, (name, res[name])
        assert max(res["packed"]) < TOL, res["packed"]
        for name, (same, scores) in res["generate"].items():
            assert same and scores < TOL, (name, res["generate"])
    assert world[0]["round_trip"]


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_tp2_sequence_parallel_and_cp2(world, layout):
    """TP2 + SP and CP2 (each rank's per-layer and AltUp streams its own tokens', the reused keys and values gathered
    over the CP group by the reusing layers): logits, loss, a left-padded row, every gradient."""
    for rank in world:
        for name in ("plain", "padded"):
            res = rank[layout][name]
            assert res["logits"] < TOL and res["loss"] < TOL, (name, res)
    grads = world[0][layout]["grads"]
    assert len(grads) > 100 and max(grads.values()) < 1e-4, sorted(grads.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("changes, layout, field", [
    ({}, dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 is not supported for Gemma3nForCausalLM: layers "
                                         "[3, 4] reuse the keys and values of layers [1, 2] on another pipeline stage "
                                         "(num_kv_shared_layers=2; the shared keys and values do not cross stages); "
                                         "no split of the 5 layers over 3 stages"),
    ({}, dict(tensor_parallel_size=4), "num_key_value_heads=2 does not split over tensor_parallel_size=4"),
    ({"altup_active_idx": 3}, None, "altup_active_idx=3 is not one of the altup_num_inputs=3 streams"),
    ({"hidden_size_per_layer_input": 0}, None, "hidden_size_per_layer_input=0 is not supported"),
    ({"num_kv_shared_layers": 5}, None, "num_kv_shared_layers=5: at least one of the 5 layers"),
    ({"attention_bias": True}, None, "attention_bias=True is not supported for Gemma3nForCausalLM"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}}}, None,
     "rope_parameters['full_attention']")])
def test_refused(folder, changes, layout, field):
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    config = transformers.AutoConfig.from_pretrained(folder)
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        get_bridge(config).check_layout(ParallelConfig(**(layout or {})))


def test_pipelines(world):
    for rank in world:
        for layout in ("pp2", "pp2_vpp2"):
            res = rank[layout]["plain"]
            assert res["logits"] < TOL and res["loss"] < TOL, (layout, res)
        res = rank["pp2"]["padded"]
        assert res["logits"] < TOL and res["loss"] < TOL, res
        same, scores = rank["pp2"]["greedy"]
        assert same and scores < TOL, rank["pp2"]["greedy"]
    assert world[0]["pp2"]["round_trip"]
    grads = world[0]["pp2_vpp2"]["grads"]
    assert len(grads) > 100 and max(grads.values()) < 1e-4, sorted(grads.items(), key=lambda kv: -kv[1])[:5]


def test_pipeline_split_keeps_shared_keys_and_values_together(world):
    """PP2 on the 5-layer model: megatron's default 3 / 2 would part layers 3, 4 from layers 1, 2, so the bridge's
    1 / 4 is built (layers 1-4 on the second stage); logits and loss within 1e-4, cached greedy generate (the
    reusing layers read the storing layers' cache on the second stage), a bit-exact export."""
    for rank in world:
        res = rank["pp2_split"]
        assert res["plain"]["logits"] < TOL and res["plain"]["loss"] < TOL, res
        same, scores = res["greedy"]
        assert same and scores < TOL, res["greedy"]
    assert [rank["pp2_split"]["layers"] for rank in world] == [[1], [4]]
    assert world[0]["pp2_split"]["round_trip"]


def test_virtual_stage_split_refused():
    """The 8-layer variant with 2 layers reusing layer 4's keys and values: PP2 keeps them on one stage, PP2 x VPP2
    (two layers a chunk) does not and is refused by name (pure, before any collective)."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("gemma3n", **{**EIGHT, "num_kv_shared_layers": 2}))
    bridge.check_layout(ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(UnsupportedConfigError, match=re.escape(
            "pipeline_parallel_size=2 with virtual_pipeline_parallel_size=2 is not supported for Gemma3nForCausalLM: "
            "layers [6, 7] reuse the keys and values of layers [4] on another pipeline stage")):
        bridge.check_layout(ParallelConfig(pipeline_parallel_size=2, virtual_pipeline_parallel_size=2))


def test_hub_layout_accepted_and_image_text_model_refused():
    """gemma-3n-E4B's text config (transformers' defaults: 4 streams, 15 layers sharing keys and values, top-k on the
    first 10) builds a bridge at TP2 and at PP2 (megatron's 18 / 17 layers: layers 18 and 19, which store the keys and
    values, on the second stage with the layers reusing them); at PP4 megatron's 9 / 9 / 9 / 8 would part layers 21-34
    from 18 / 19, so the bridge splits 6 / 6 / 6 / 17; PP20 has no split that keeps them together and is refused, as is
    a user's first / last stage size that parts them (``megatron_config``); the hub's image-text-audio model is refused
    by name."""
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.registry import UnsupportedArchitectureError
    from loongforge_hf.bridges.stage_boundary import pipeline_split
    from loongforge_hf.parallel import ParallelConfig

    config = transformers.Gemma3nTextConfig()
    config.architectures = ["Gemma3nForCausalLM"]
    bridge = get_bridge(config)
    bridge.check_layout(ParallelConfig(tensor_parallel_size=2))
    bridge.check_layout(ParallelConfig(pipeline_parallel_size=2))
    first, last = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"
    assert pipeline_split(bridge, ParallelConfig(pipeline_parallel_size=2)) == {first: 18}
    pp4 = ParallelConfig(pipeline_parallel_size=4)
    bridge.check_layout(pp4)
    assert pipeline_split(bridge, pp4) == {last: 17}
    assert pipeline_split(bridge, pp4, {first: 12, last: 17}) == {first: 12, last: 17}  # NOTE: 12 / 3 / 3 / 17
    with pytest.raises(UnsupportedConfigError, match=re.escape(
            "megatron_config {'num_layers_in_last_pipeline_stage': 11} (stages of [8, 8, 8, 11] layers) is not "
            f"supported for Gemma3nForCausalLM: layers {list(range(24, 35))} reuse the keys and values of layers")):
        pipeline_split(bridge, pp4, {last: 11})
    with pytest.raises(UnsupportedConfigError, match=re.escape(
            f"pipeline_parallel_size=20 is not supported for Gemma3nForCausalLM: layers {list(range(20, 35))} reuse "
            "the keys and values of layers [18, 19] on another pipeline stage (num_kv_shared_layers=15; the shared "
            "keys and values do not cross stages); no split of the 35 layers over 20 stages")):
        bridge.check_layout(ParallelConfig(pipeline_parallel_size=20))
    assert len(bridge.reusing_layers) == 15 and bridge.mlp_module() is not None
    full = transformers.Gemma3nConfig()
    full.architectures = ["Gemma3nForConditionalGeneration"]
    with pytest.raises(UnsupportedArchitectureError, match="Gemma3nForConditionalGeneration is not supported: "
                                                           "Gemma 3n's image-text-audio model"):
        get_bridge(full)
