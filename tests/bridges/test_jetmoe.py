"""JetMoE (JetMoeForCausalLM: a mixture of attention heads and a mixture of experts in every layer), fp32 against
transformers within 1e-4, in one world of two ranks: layouts TP1 (DP2), TP2 + SP (the MoE experts split over TP too),
TP2 + SP x EP2 (each rank two whole MoE experts) and CP2, each with two rows of 40 tokens, the second left-padded by 5
(logits at the real tokens, loss), and a row packing documents of 7, 20 and 11 tokens against each document alone; at
TP1 the ``output_router_logits`` keyword refused; at TP2 + SP greedy and 2-beam cached generate of a left-padded batch
(transformers' tokens); at TP2 + SP x EP2 and CP2 every parameter's gradient (exported through the bridge, against
transformers', relative to each tensor's largest); a bit-exact export round trip from TP2 + SP x EP2. The refused
fields and layouts are checked on the bridge alone (pure, before any collective)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
LAYOUTS = {"tp1": {}, "tp2_sp": dict(tensor_parallel_size=2, sequence_parallel=True),
           "tp2_sp_ep2": dict(tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2,
                              expert_tensor_parallel_size=1),
           "cp2": dict(context_parallel_size=2)}


def _padded(ours, ref) -> dict:
    from .test_granitemoehybrid import _ids

    ids = _ids((2, 40))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    with torch.no_grad():
        got, want = ours(**kw), ref(**kw)
    return {"logits": float((got.logits - want.logits).abs()[mask.bool()].max()),
            "loss": float(abs(got.loss - want.loss))}


def _cached_generate(ours, ref) -> dict:
    """Greedy and 2-beam cached generate of a left-padded batch of two: transformers' tokens."""
    from .test_granitemoehybrid import _ids

    ids = _ids((2, 7), seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3], ids[0, :3] = 0, 0
    out = {}
    for name, kw in {"greedy": {}, "beams": {"num_beams": 2}}.items():
        args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
        out[name] = torch.equal(ours.generate(ids, **args), ref.generate(ids, **args))
    return out


def _router_outputs_refusal(ours) -> str | None:
    """The error of a forward asking for ``output_router_logits`` by keyword (None: none raised)."""
    from loongforge_hf.bridges import UnsupportedConfigError

    try:
        ours(input_ids=torch.ones(1, 4, dtype=torch.long), output_router_logits=True)
    except UnsupportedConfigError as e:
        return str(e)
    return None


def _two_ranks(folder: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.round_trip import check_round_trip

    from .test_granitemoehybrid import _gradients
    from .test_qwen3_5 import packed_against_alone

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    for name, layout in LAYOUTS.items():
        ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        out[name] = {**_padded(ours, ref), "packed": max(packed_against_alone(ours, ref))}
        if name == "tp1":
            out["router_refusal"] = _router_outputs_refusal(ours)
        if name == "tp2_sp":
            out["generate"] = _cached_generate(ours, ref)
        if name == "tp2_sp_ep2":
            ours.save_pretrained(f"{folder}-saved")  # NOTE: one folder for all ranks (written by the first)
        if name in ("tp2_sp_ep2", "cp2"):
            out[f"grads_{name}"] = _gradients(ours, ref, folder, name)
    check_round_trip(folder, f"{folder}-saved")
    out["round_trip"] = True
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("jetmoe") / "jetmoe", "jetmoe"))


@pytest.fixture(scope="module")
def two_ranks(folder):
    return run_distributed(_two_ranks, 2, folder, timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_left_padded_and_packed(two_ranks, layout):
    """Logits, loss and packed documents (each against transformers' run of the document alone) on every rank."""
    for res in two_ranks:
        assert max(res[layout].values()) < TOL, (layout, res[layout])


@pytest.mark.parametrize("layout", ("tp2_sp_ep2", "cp2"))
def test_every_gradient(two_ranks, layout):
    """Every HF tensor's gradient: the attention and MoE routers (through the gates), the attention experts' query /
    output stacks split by KV heads, ``kv_proj``, both output biases, the experts split over EP and TP, the norms."""
    grads = two_ranks[0][f"grads_{layout}"]
    assert any(n.endswith("self_attention.experts.router.layer.weight") for n in grads) and \
        any(n.endswith("mlp.bias") for n in grads), sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, worst


def test_router_outputs_by_keyword_refused(two_ranks):
    """transformers would return the attention and MoE routers' logits and add ``aux_loss_coef`` times its balancing
    loss: refused before any collective, on every rank."""
    for res in two_ranks:
        assert res["router_refusal"] and "output_router_logits=True is not supported for JetMoeForCausalLM" in \
            res["router_refusal"], res["router_refusal"]


def test_cached_generate_tp2_sp(two_ranks):
    assert all(res["generate"] == {"greedy": True, "beams": True} for res in two_ranks), two_ranks[0]["generate"]


def test_export_round_trip_tp2_sp_ep2(two_ranks):
    assert all(res["round_trip"] for res in two_ranks)


def _bridge(**overrides):
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    return get_bridge(_config("jetmoe", architectures=["JetMoeForCausalLM"], **overrides))


@pytest.mark.parametrize("overrides,field", [
    ({"activation_function": "gelu"}, "activation_function='gelu'"),
    ({"output_router_logits": True}, "output_router_logits=True"),
])
def test_fields_refused(overrides, field):
    from loongforge_hf.bridges import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match=field):
        _bridge(**overrides)


def test_layouts_refused_and_config():
    """KV heads that do not split over TP, by the pure layout check; the layers' norms keep
    transformers' 1e-6 while the final one reads ``rms_norm_eps``; k x KV heads of megatron query heads."""
    from loongforge_hf.bridges import UnsupportedConfigError
    from loongforge_hf.parallel.config import ParallelConfig

    bridge = _bridge()
    with pytest.raises(UnsupportedConfigError, match="num_key_value_heads=2 .*tensor_parallel_size=4"):
        bridge.check_layout(ParallelConfig(tensor_parallel_size=4))
    bridge.check_layout(ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2))
    kw = bridge.transformer_config_kwargs()
    assert (kw["layernorm_epsilon"], kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]) == \
        (1e-6, 4, 2, 16), kw
