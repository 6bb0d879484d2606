"""Doge (DogeForCausalLM: dynamic-mask attention, learned residual scales; ``is_moe``: cross-domain experts by product
keys), fp32 against transformers within 1e-4, in one world of two ranks: layouts TP1 (DP2), TP2 + SP, PP2 and CP2, the
dense and the CDMoE tiny model (``A`` and the residual scales randomised), each on two rows of 40 tokens, the second
left-padded by 5 (logits at the real tokens, loss; ``keep_window_size`` 24 binds; the dense model on the hub's
``dynamic`` rope), the dense one also on a row packing documents against each alone; at TP2 + SP and CP2 the CDMoE
model's every gradient (exported through the bridge); bit-exact export round trips from TP2 + SP and PP2. Cached
``generate`` of a left-padded batch (prompts of 30 tokens, so the kept window binds at every step) gives
transformers' cached tokens: greedy and 2-beam for the dense model at TP2 + SP, greedy at PP2 and, for CDMoE (whose
routing mixes the step's tokens: transformers' cached and uncached tokens differ), at TP1 and PP2; the dense model's
uncached greedy generate at CP2. Refused on every rank: an odd length for CDMoE at TP2 + SP (the layout's padding
would change the routing), a KV cache for CDMoE under sequence parallelism and under CP. The refused fields, layouts
and caches are checked on the bridge alone (pure, before any collective)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

TOL = 1e-4
LAYOUTS = {"tp1": {}, "tp2_sp": dict(tensor_parallel_size=2, sequence_parallel=True),
           "pp2": dict(pipeline_parallel_size=2), "cp2": dict(context_parallel_size=2)}
# NOTE: (kind, layout) -> the cached generate modes checked there against transformers' tokens
CACHED_GENERATE = {("dense", "tp2_sp"): ("greedy", "beams"), ("dense", "pp2"): ("greedy",),
                   ("moe", "tp1"): ("greedy",), ("moe", "pp2"): ("greedy",)}


def _refusal(call) -> str | None:
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def _generate(ours, ref, modes=("greedy",), use_cache: bool = True) -> dict:
    """Per mode, whether ``generate`` of a left-padded batch of two 30-token prompts gives transformers' tokens."""
    from .test_granitemoehybrid import _ids

    ids = _ids((2, 30), seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3], ids[0, :3] = 0, 0
    out = {}
    for mode in modes:
        args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=use_cache,
                    num_beams=2 if mode == "beams" else 1)
        out[mode] = torch.equal(ours.generate(ids, **args), ref.generate(ids, **args))
    return out


def _two_ranks(folders: dict) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.round_trip import check_round_trip

    from .test_granitemoehybrid import _gradients
    from .test_jetmoe import _padded, _router_outputs_refusal
    from .test_qwen3_5 import packed_against_alone

    out = {}
    for kind, folder in folders.items():
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for name, layout in LAYOUTS.items():
            ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
            res = _padded(ours, ref)
            if kind == "dense":
                res["packed"] = max(packed_against_alone(ours, ref))
            out[f"{kind}_{name}"] = res
            if (kind, name) in CACHED_GENERATE:
                out[f"generate_{kind}_{name}"] = _generate(ours, ref, CACHED_GENERATE[kind, name])
            if kind == "dense" and name == "cp2":
                out["uncached_generate_cp2"] = _generate(ours, ref, use_cache=False)
            if kind == "moe" and name == "tp1":
                out["router_refusal"] = _router_outputs_refusal(ours)
            if kind == "moe" and name == "tp2_sp":
                out["odd_length"] = _refusal(lambda: ours(input_ids=torch.ones(1, 7, dtype=torch.long)))
            if kind == "moe" and name in ("tp2_sp", "pp2"):
                ours.save_pretrained(f"{folder}-{name}-saved")  # NOTE: one folder for all ranks (the first writes)
                check_round_trip(folder, f"{folder}-{name}-saved")
                out[f"round_trip_{name}"] = True
            if kind == "moe" and name in ("tp2_sp", "cp2"):  # NOTE: last: _gradients overwrites the weights
                ids = torch.ones(1, 8, dtype=torch.long)
                out[f"generate_refusal_{name}"] = _refusal(
                    lambda: ours.generate(ids, max_new_tokens=2, do_sample=False))
                out[f"grads_{name}"] = _gradients(ours, ref, folder, name)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from loongforge_hf.testing import make_tiny_checkpoint
    from loongforge_hf.testing.tiny_doge import randomize

    root = tmp_path_factory.mktemp("doge")
    out = {kind: str(make_tiny_checkpoint(root / kind, arch))
           for kind, arch in (("dense", "doge"), ("moe", "doge_moe"))}
    for folder in out.values():
        randomize(folder)
    return out


@pytest.fixture(scope="module")
def two_ranks(folders):
    return run_distributed(_two_ranks, 2, folders, timeout=300)


def test_dynamic_mask_binds(folders):
    """On the parity input, transformers' logits move by more than 1e-2 without the top-k (``keep_window_size`` past
    the length) and without the bias (``A`` zero): the parity holds both to account."""
    import transformers

    from .test_granitemoehybrid import _ids

    model = transformers.AutoModelForCausalLM.from_pretrained(folders["dense"], dtype=torch.float32).eval()
    ids = _ids((2, 40))
    attention = [layer.self_attn for layer in model.model.layers]
    with torch.no_grad():
        base = model(ids).logits
        for a in attention:
            a.keep_window_size = 1 << 20
        unkept = model(ids).logits
        for a in attention:
            a.keep_window_size = 24
            a.A.zero_()
        flat = model(ids).logits
    assert float((base - unkept).abs().max()) > 1e-2 and float((base - flat).abs().max()) > 1e-2


@pytest.mark.parametrize("case", [f"{kind}_{name}" for kind in ("dense", "moe") for name in LAYOUTS])
def test_layouts_left_padded(two_ranks, case):
    """Logits and loss (and the dense model's packed documents, each against transformers' run of it alone)."""
    for res in two_ranks:
        assert max(res[case].values()) < TOL, (case, res[case])


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2"])
def test_every_gradient(two_ranks, layout):
    """Every HF tensor's gradient: ``A`` and ``dt_proj`` (split with the KV heads; under CP over the gathered
    values), the residual scales, the router and both embedding tables (replicated; under CP routed over the gathered
    logits), the shared MLP, q / k norms."""
    grads = two_ranks[0][f"grads_{layout}"]
    assert {"model.layers.0.self_attn.A", "model.layers.0.self_attn.dt_proj.weight", "model.layers.0.input_residual",
            "model.layers.0.mlp.router_gate.weight", "model.layers.0.mlp.up_embed.weight"} <= set(grads), sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, worst


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_export_round_trip(two_ranks, layout):
    assert all(res[f"round_trip_{layout}"] for res in two_ranks)


@pytest.mark.parametrize("case", [f"{kind}_{name}" for kind, name in CACHED_GENERATE])
def test_cached_generate_left_padded(two_ranks, case):
    """Cached generate past ``keep_window_size`` (the biases recomputed from the cached values): transformers'
    tokens on every rank (CDMoE: its cached tokens, which its uncached ones are not)."""
    for res in two_ranks:
        assert all(res[f"generate_{case}"].values()), res[f"generate_{case}"]


def test_uncached_generate_cp2(two_ranks):
    for res in two_ranks:
        assert res["uncached_generate_cp2"]["greedy"], res["uncached_generate_cp2"]


def test_refused_on_every_rank(two_ranks):
    """CDMoE at TP2 + SP: 7 tokens (padded to 8 by the layout) refused, and a KV cache (each cached step padded);
    under CP2 a KV cache refused."""
    for res in two_ranks:
        assert res["odd_length"] and "a sequence of 7 tokens" in res["odd_length"], res["odd_length"]
        sp, cp = res["generate_refusal_tp2_sp"], res["generate_refusal_cp2"]
        assert sp and "is_moe=True under sequence parallelism" in sp and "use_cache=False" in sp, sp
        assert cp and "context_parallel_size=2" in cp and "use_cache=False" in cp, cp


def test_router_outputs_by_keyword_refused(two_ranks):
    """transformers would return CDMoE's router logits and add its balancing loss: refused on every rank."""
    for res in two_ranks:
        assert res["router_refusal"] and "output_router_logits=True is not supported for DogeForCausalLM" in \
            res["router_refusal"], res["router_refusal"]


def _bridge(arch="doge", **overrides):
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    return get_bridge(_config(arch, **overrides))


@pytest.mark.parametrize("arch,overrides,field", [
    ("doge", {"sliding_window": 8}, "sliding_window=8"),
    ("doge", {"keep_window_size": 0}, "keep_window_size=0"),
    ("doge", {"attention_bias": True}, "attention_bias=True"),
    ("doge", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='linear'"),
    ("doge_moe", {"output_router_logits": True}, "output_router_logits=True"),
    ("doge_moe", {"num_experts_per_tok": 17}, "num_experts_per_tok=17"),
])
def test_fields_refused(arch, overrides, field):
    from loongforge_hf.bridges import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match=field):
        _bridge(arch, **overrides)


@pytest.mark.parametrize("layout,field", [
    (dict(tensor_parallel_size=4), "num_key_value_heads=2 .*tensor_parallel_size=4"),
    (dict(expert_parallel_size=2), "expert_parallel_size=2"),
])
def test_layouts_refused(layout, field):
    from loongforge_hf.bridges import UnsupportedConfigError
    from loongforge_hf.parallel.config import ParallelConfig

    with pytest.raises(UnsupportedConfigError, match=field):
        _bridge("doge_moe").check_layout(ParallelConfig(**layout))


@pytest.mark.parametrize("arch,layout,generation,refusal", [
    ("doge", {}, {"cache_implementation": "static"}, "cache_implementation='static'"),
    ("doge", dict(context_parallel_size=2), {}, "context_parallel_size=2"),
    ("doge_moe", dict(tensor_parallel_size=2, sequence_parallel=True), {}, "is_moe=True under sequence parallelism"),
    ("doge_moe", dict(context_parallel_size=2), {"use_cache": False}, None),
    ("doge_moe", dict(tensor_parallel_size=2, pipeline_parallel_size=2), {}, None),
    ("doge", dict(tensor_parallel_size=2, sequence_parallel=True), {}, None),
])
def test_cache_refusals(arch, layout, generation, refusal):
    """Which caches generate refuses under which layout (the bridge alone; ``generation_refusal``)."""
    import transformers

    from loongforge_hf.parallel.config import ParallelConfig

    bridge = _bridge(arch)
    bridge.check_layout(ParallelConfig(**layout))
    got = bridge.generation_refusal(transformers.GenerationConfig(**{"use_cache": True, **generation}))
    assert (got is None) if refusal is None else (got is not None and refusal in got), got


def test_dynamic_rope_plain_up_to_max_positions():
    """The hub's ``dynamic`` rope (the tiny dense model's): megatron's plain rope at its theta, sequences past
    ``max_position_embeddings`` (128) refused naming the field; 128 taken."""
    doge = _bridge("doge")
    assert doge.rope_parameters() == {"rope_type": "default", "rope_theta": 10000.0}
    doge.check_sequence_length(128)
    with pytest.raises(ValueError, match="129 positions: rope_parameters.rope_type='dynamic'"):
        doge.check_sequence_length(129)


def test_tensor_table():
    """The CDMoE model's tensors beside Llama's: ``A`` / ``dt_proj`` per KV head, the residual scales, 2 x 4 product
    keys over 16 experts."""
    shapes = _bridge("doge_moe").expected_hf_shapes()
    p = "model.layers.1"
    assert shapes[f"{p}.self_attn.A"] == (2,) and shapes[f"{p}.self_attn.dt_proj.weight"] == (2, 32)
    assert shapes[f"{p}.input_residual"] == shapes[f"{p}.post_attention_residual"] == (64,)
    assert shapes[f"{p}.mlp.router_gate.weight"] == (8, 64) and shapes[f"{p}.mlp.down_embed.weight"] == (16, 64)
    assert shapes[f"{p}.mlp.gate_proj.weight"] == (96, 64) and f"{p}.mlp.up_embed.weight" in shapes
