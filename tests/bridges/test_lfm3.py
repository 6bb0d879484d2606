"""LFM3 (Lfm3ForCausalLM: short-conv, sliding-window and full-attention layers, a per-head sigmoid output gate from its
own projection, sandwich norms, a proportional rope on the full layers), fp32 against transformers within 1e-4.
One world of two ranks: TP1 (each rank the whole model): 70-token rows with the second left-padded by 9 (logits,
loss; also with the gate and the sandwich norms off), a row packing documents against each document alone, cached
greedy and beam search over a left-padded batch (the KV layers and the conv states in the cache), the refused static
cache, a bit-exact export round trip; TP2 with sequence parallelism (logits, loss, every parameter's gradient
exported through the bridge, cached greedy), PP2 and CP2 (Qwen3.5's checks: packed documents and left padding
across the chunks, every gradient, an uncached generate). The refusals are checked on the bridge alone (pure,
before any collective)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .test_lfm2 import _cached_generate, _config, _models, _padded

TOL = 1e-4


def _round_trip(ours, folder: str) -> bool:
    from loongforge_hf.testing.round_trip import check_round_trip

    ours.save_pretrained(f"{folder}-saved")
    check_round_trip(folder, f"{folder}-saved")
    return True


def _world(folders: dict) -> dict:
    """The checks of the module docstring, in one world of two ranks."""
    import loongforge_hf as lf

    from .test_granitemoehybrid import _gradients
    from .test_qwen3_5 import _cp2_checks, packed_against_alone

    folder = folders["lfm3"]
    ours, ref = _models(folder)
    out = {"padded": _padded(ours, ref), "packed": packed_against_alone(ours, ref),
           **_cached_generate(ours, ref, beams=True), "round_trip": _round_trip(ours, folder)}
    try:
        ours.generate(input_ids=torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, cache_implementation="static")
        out["static_refusal"] = None
    except ValueError as e:
        out["static_refusal"] = str(e)
    out["plain"] = _padded(*_models(folders["plain"]))
    ours, _ = _models(folder, tensor_parallel_size=2, sequence_parallel=True)
    out.update(tp2=_padded(ours, ref), tp2_generate=_cached_generate(ours, ref, beams=False),
               grads=_gradients(ours, ref, folder, "tp2"))
    del ours
    out["pp2"] = _padded(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2),
                         ref)
    out["cp2"] = _cp2_checks(folder, ref)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfm3")
    return {"lfm3": str(make_tiny_checkpoint(root / "lfm3", "lfm3")),
            "plain": str(make_tiny_checkpoint(root / "plain", "lfm3", use_attention_gate=False,
                                              use_sandwich_norm=False))}


@pytest.fixture(scope="module")
def world(folders):
    return run_distributed(_world, 2, folders, timeout=300)


@pytest.mark.parametrize("layout", ("padded", "plain", "tp2", "pp2"))
def test_left_padded_rows(world, layout):
    """Logits on real tokens and the loss; ``plain``: a checkpoint with ``use_attention_gate`` and
    ``use_sandwich_norm`` off."""
    for res in world:
        assert max(res[layout].values()) < TOL, res[layout]


def test_packed_documents(world):
    """A row packing documents of 7, 20 and 11 tokens (position ids restarting at 0): each document's logits as
    transformers gives them for the document alone (the conv restarts, the window stays inside the document)."""
    for res in world:
        assert max(res["packed"]) < TOL, res["packed"]


@pytest.mark.parametrize("layout, name", (("one", "greedy"), ("one", "beam"), ("tp2", "greedy")))
def test_cached_generate_left_padded_batch(world, layout, name):
    """transformers' tokens and scores; one KV layer per attention layer (1, 3, 4), then one state layer per conv layer
    (0, 2, 5) holding the last ``conv_L_cache`` = 3 conv inputs of this rank's channels (64 / TP)."""
    for res in world:
        got = res if layout == "one" else res["tp2_generate"]
        same, scores = got[name]
        assert same and scores < TOL, got[name]
        kinds, state = got["cache_layers"]
        assert kinds == ["DynamicLayer"] * 3 + ["LinearAttentionLayer"] * 3, kinds
        assert state == ((2, 64 if layout == "one" else 32, 3), torch.float32), state


def test_static_cache_refused(world):
    refusal = world[0]["static_refusal"]
    assert refusal is not None and "cache_implementation='static' is not supported for Lfm3ForCausalLM" in refusal, \
        refusal


def test_export_round_trip(world):
    """Bit-exact, the gate under the hub's name (``self_attn.gate_proj``)."""
    assert world[0]["round_trip"]


def test_every_gradient_tp2_sequence_parallel(world):
    """Every parameter: the gate's rows split over TP by heads, the post norms, the conv's channels."""
    grads = world[0]["grads"]
    assert any(".self_attn.g_proj." in n for n in grads) and any(".post_operator_norm." in n for n in grads), grads
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_context_parallel_padded_packed_and_generate(world):
    """CP2 (four chunks of 38 tokens) over a packed row and a left-padded one (``test_qwen3_5._cp2_padded_and_packed``):
    logits and loss on both ranks' shares, every gradient; an uncached greedy generate; a cached one refused."""
    for rank, res in enumerate(world):
        cp = res["cp2"]
        assert cp["logits"] < TOL and cp["loss"] < TOL, (rank, cp)
        same, scores = cp["generate"]
        assert same and scores < TOL, (rank, cp["generate"])
        assert "under context parallelism generate with use_cache=False" in cp["cached_refusal"], cp["cached_refusal"]
    grads = world[0]["cp2"]["grads"]
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_refusals_and_shapes(folders):
    """Pure: the channels over TP, an unknown layer type, attention biases, rope types the bridge does not rotate,
    sliding layers without a window; the hub's tensor names with and without the gate and the sandwich norms."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    folder = folders["lfm3"]
    with pytest.raises(UnsupportedConfigError, match="hidden_size=64 does not split over tensor_parallel_size=3"):
        get_bridge(_config(folder)).check_layout(ParallelConfig(tensor_parallel_size=3))
    with pytest.raises(UnsupportedConfigError, match=r"layer_types \['conv', 'mamba'"):
        get_bridge(_config(folder, layer_types=["conv", "mamba"] + ["conv"] * 4))
    with pytest.raises(UnsupportedConfigError, match="attention_bias=True is not supported for Lfm3ForCausalLM"):
        get_bridge(_config(folder, attention_bias=True))
    yarn = {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(UnsupportedConfigError, match=r"rope_parameters\['full_attention'\].*Lfm3ForCausalLM"):
        get_bridge(_config(folder, rope_parameters=yarn))
    with pytest.raises(UnsupportedConfigError, match="sliding_window=None with sliding_attention layers"):
        get_bridge(_config(folder, sliding_window=None))
    shapes = get_bridge(_config(folder)).expected_hf_shapes()
    assert shapes["model.layers.1.self_attn.gate_proj.weight"] == (4, 64) and \
        "model.layers.0.post_operator_norm.weight" in shapes and "model.layers.3.post_ffn_norm.weight" in shapes
    plain = get_bridge(_config(folders["plain"])).expected_hf_shapes()
    assert not [n for n in plain if "gate_proj" in n or ".post_" in n], sorted(plain)


def test_lora_output_gate_target(folders):
    """Pure: transformers' (PEFT's) ``g_proj`` is a column-parallel target on our ``linear_gate`` (one row per head),
    its slot under the hub's name ``gate_proj`` (the weight's on disk); its values against PEFT, the adapter folder
    and the merged export run in tests/integrations/test_lora_new_bridges.py."""
    import peft

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora.plan import plan_lora

    plan = plan_lora(get_bridge(_config(folders["lfm3"])), peft.LoraConfig(r=2, target_modules=["g_proj"]))
    assert [(t.hf_module, t.layer) for t in plan.targets] == [
        (f"model.layers.{i}.self_attn.g_proj", i) for i in (1, 3, 4)]
    t = plan.targets[0]
    assert (t.kind, t.name, t.megatron_module, t.in_features, t.out_features) == (
        "column", "gate_proj", "decoder.layers.{layer}.self_attention.linear_gate", 64, 4), t
