"""JetMoE (JetMoeForCausalLM: a mixture of attention heads and a mixture of experts in every layer), fp32 against
transformers within 1e-4, in one world of two ranks: layouts TP1 (DP2), TP2 + SP (the MoE experts split over TP too),
TP2 + SP x EP2 (each rank two whole MoE experts) and CP2, each with two rows of 40 tokens, the second left-padded by 5
(logits at the real tokens, loss), and a row packing documents of 7, 20 and 11 tokens against each document alone; at
TP1, TP2 + SP and CP2 ``output_router_logits=True`` (the attention and MoE routers' logits, the balancing loss and
the loss with it, within 1e-5); at TP2 + SP greedy and 2-beam cached generate of a left-padded batch (transformers'
tokens) and every parameter's gradient of the loss with the balancing loss (coefficient 1), and the training
engine's at TP2 + SP x EP2; at TP2 + SP x EP2 and CP2 every parameter's gradient of the loss (exported through the
bridge, against transformers', relative to each tensor's largest); a bit-exact export round trip from TP2 + SP x EP2;
LoRA with ``"all-linear"`` (``kv_proj`` and both routers ``router.layer``) against PEFT at TP1 and TP2 + SP (logits,
loss, every adapter's gradient, the adapter folder in PEFT) and the attention's checkpoint shards with it at TP2 + SP.
The refused fields, layouts and LoRA targets are checked on the bridge alone (pure, before any collective)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
# LoRA as PEFT adapts it: "all-linear" is the shared key / value projection and both routers, the attention's (a
# parameter of our mixture of heads: lora/own_weights.py) and the MoE's (megatron's router: lora/experts.py);
# init_lora_weights=False keeps B random
LORA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
LORA_LAYOUTS = {"tp1": {}, "tp2_sp": dict(tensor_parallel_size=2, sequence_parallel=True)}
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
    """The error of a forward asking for ``output_router_logits`` by keyword (None: none raised; test_doge's)."""
    from loongforge_hf.bridges import UnsupportedConfigError

    try:
        ours(input_ids=torch.ones(1, 4, dtype=torch.long), output_router_logits=True)
    except UnsupportedConfigError as e:
        return str(e)
    return None


def _router_batch() -> dict:
    from .test_granitemoehybrid import _ids

    ids = _ids((2, 40), seed=4)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)


def _router_outputs(ours, ref) -> dict:
    """``output_router_logits`` by keyword on a left-padded batch: transformers' ``router_logits`` (the attention's
    and the MoE layer's router of each layer), ``aux_loss`` and the loss with ``aux_loss_coef`` times it."""
    with torch.no_grad():
        got, want = ours(**_router_batch()), ref(**_router_batch())
        without = ref(**{**_router_batch(), "output_router_logits": False}).loss
    pairs = list(zip(got.router_logits, want.router_logits))
    return {"count": (len(got.router_logits), len(want.router_logits)),
            "shapes": {(tuple(a.shape), tuple(b.shape)) for a, b in pairs},
            "router_logits": max(float((a - b).abs().max()) for a, b in pairs),
            "aux": float(abs(got.aux_loss - want.aux_loss)), "loss": float(abs(got.loss - want.loss)),
            "aux_in_loss": float(abs(want.loss - without))}


def _aux_gradients(ours, ref, folder: str) -> dict | None:
    """Every parameter's gradient of the loss with the balancing loss (coefficient 1 in both models), exported through
    the bridge, against transformers' (rank 0: relative to each tensor's largest; None elsewhere)."""
    import torch.distributed as dist

    from ._gradients import gradient_diffs, save_gradients

    ours.config.aux_loss_coef = 1.0
    ours(**_router_batch()).loss.backward()
    save_gradients(ours, f"{folder}-aux-grads")
    if dist.get_rank() != 0:
        return None
    ref.aux_loss_coef = 1.0  # NOTE: transformers' model reads the coefficient it kept at init
    ref.zero_grad()
    ref(**_router_batch()).loss.backward()
    ref.aux_loss_coef = ref.config.aux_loss_coef
    return gradient_diffs(f"{folder}-aux-grads", ref)


def _engine_gradients(folder: str, layout: dict) -> dict | None:
    """The training engine's gradients (one micro-batch, the config's ``output_router_logits`` with
    ``aux_loss_coef=1``: the engine adds the balancing term as transformers.Trainer) against transformers' loss with
    it (rank 0, as ``_aux_gradients``)."""
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf

    from ._gradients import _save_engine_gradients, gradient_diffs
    from .test_granitemoehybrid import _ids

    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    ours.config.output_router_logits, ours.config.aux_loss_coef = True, 1.0
    ids = _ids((2, 12), seed=6)
    _save_engine_gradients(ours, ids, f"{folder}-engine-grads")
    if dist.get_rank() != 0:
        return None
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                            output_router_logits=True, aux_loss_coef=1.0)
    ref(input_ids=ids, labels=ids).loss.backward()
    return gradient_diffs(f"{folder}-engine-grads", ref)


def _attention_shards(model) -> dict:
    """{layer 0's attention tensor: (global shape, this rank's offset)} of megatron's checkpoint shards."""
    from megatron.core import parallel_state as ps

    sharded = model.chunks[0].sharded_state_dict(metadata={
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    prefix = "decoder.layers.0.self_attention."
    return {k.removeprefix(prefix): (tuple(v.global_shape), tuple(v.global_offset)) for k, v in sharded.items()
            if k.startswith(prefix) and getattr(v, "data", None) is not None}


def _two_ranks(folder: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.round_trip import check_round_trip

    from ._lora_parity import lora_against_peft
    from .test_granitemoehybrid import _gradients
    from .test_qwen3_5 import packed_against_alone

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {f"lora_{name}": lora_against_peft(folder, f"{folder}-lora-{name}", layout, LORA_KW, _attention_shards)
           for name, layout in LORA_LAYOUTS.items()}
    for name, layout in LAYOUTS.items():
        ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        out[name] = {**_padded(ours, ref), "packed": max(packed_against_alone(ours, ref))}
        if name in ("tp1", "tp2_sp", "cp2"):
            out[f"router_{name}"] = _router_outputs(ours, ref)
        if name == "tp2_sp":
            out["generate"] = _cached_generate(ours, ref)
            out["grads_aux"] = _aux_gradients(ours, ref, folder)  # NOTE: last: the weights now hold gradients
        if name == "tp2_sp_ep2":
            ours.save_pretrained(f"{folder}-saved")  # NOTE: one folder for all ranks (written by the first)
        if name in ("tp2_sp_ep2", "cp2"):
            out[f"grads_{name}"] = _gradients(ours, ref, folder, name)
    out["grads_engine"] = _engine_gradients(folder, LAYOUTS["tp2_sp_ep2"])
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


@pytest.mark.parametrize("layout", ("tp1", "tp2_sp", "cp2"))
def test_router_outputs(two_ranks, layout):
    """``output_router_logits=True``: per layer the attention experts' router then the MoE one (8 of ``[80, 4]``,
    gathered over the sequence- and context-parallel ranks), transformers' balancing loss over all of them and the
    loss with ``aux_loss_coef`` times it, within 1e-5 on every rank (the balancing term moves transformers' loss
    beyond that)."""
    for res in two_ranks:
        r = res[f"router_{layout}"]
        assert r["count"] == (8, 8) and r["shapes"] == {((80, 4), (80, 4))}, r
        assert max(r["router_logits"], r["aux"], r["loss"]) < 1e-5 < r["aux_in_loss"], r


@pytest.mark.parametrize("case", ("grads_aux", "grads_engine"))
def test_gradients_with_balancing_loss(two_ranks, case):
    """Every HF tensor's gradient of the loss plus the balancing loss (coefficient 1), within 1e-4: the model's
    forward at TP2 + SP (the attention's router reads every token: its own rows' gradient gathered back), and the
    training engine's step at TP2 + SP x EP2 (it adds the term as transformers.Trainer)."""
    grads = two_ranks[0][case]
    assert any(n.endswith("self_attention.experts.router.layer.weight") for n in grads), sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, worst


@pytest.mark.parametrize("layout", LORA_LAYOUTS)
def test_lora_matches_peft(two_ranks, layout):
    """LoRA on ``kv_proj`` (megatron's column-parallel ``linear_qkv.kv``: B's rows in its per-rank ``[k; v]`` order)
    and both routers of each layer (``router.layer``: the attention's whole on every rank, the MoE's in megatron's
    gating) against PEFT on transformers' model: logits, loss, every adapter's gradient (relative to its largest) and
    our adapter folder loaded by PEFT, within 1e-4."""
    for res in two_ranks:
        r = res[f"lora_{layout}"]
        assert r["targets"] == ["kv_proj", "layer"] and r["graded"] == 2 * 12, r
        assert max(r["logits"], r["loss"], r["grads"]) < TOL, r
    assert two_ranks[0][f"lora_{layout}"]["adapter_logits"] < TOL, two_ranks[0][f"lora_{layout}"]


def test_lora_checkpoint_shards_tp2_sp(two_ranks):
    """megatron's checkpoint shards of the mixture of attention heads with LoRA on ``kv_proj`` and the router at
    TP2 + SP: the query and output stacks and ``kv_proj`` (and its adapter's B) split by heads as each rank holds
    them, the router and its adapter, the output bias and ``kv_proj``'s A whole."""
    for rank, res in enumerate(two_ranks):
        assert res["lora_tp2_sp"]["inspected"] == {
            "linear_qkv.router": ((4, 64), (0, 0)), "linear_qkv.query": ((4, 32, 64), (0, 16 * rank, 0)),
            "linear_qkv.kv.weight": ((64, 64), (32 * rank, 0)), "linear_qkv.kv.lora.kv_proj.A": ((4, 64), (0, 0)),
            "linear_qkv.kv.lora.kv_proj.B": ((64, 4), (32 * rank, 0)),
            "linear_qkv.lora.layer.A": ((4, 64), (0, 0)), "linear_qkv.lora.layer.B": ((4, 4), (0, 0)),
            "linear_proj.weight": ((4, 64, 32), (0, 0, 16 * rank)), "linear_proj.bias": ((64,), (0,))}, res


@pytest.mark.parametrize("lora_kw,named", [
    (dict(target_modules="all-linear", lora_dropout=0.1),
     "lora_dropout=0.1 with LoRA on the router's linear (['layer']"),
    (dict(target_parameters=["mlp.input_linear.weight"]), "['mlp.input_linear.weight'] on JetMoeForCausalLM match")])
def test_lora_refused_by_name(lora_kw, named):
    """The expert stacks (PEFT's ``target_parameters``) and ``lora_dropout`` on the routers (the MoE's adapter is
    added to megatron's gating weight), by the pure planner; 'all-linear' without the routers plans ``kv_proj`` alone,
    with them each layer's attention router (our module's own weight) and MoE router too."""
    import re

    import peft

    from loongforge_hf.lora.plan import LoraConfigError, plan_lora

    with pytest.raises(LoraConfigError, match=re.escape(named)):
        plan_lora(_bridge(), peft.LoraConfig(r=4, **lora_kw))
    plan = plan_lora(_bridge(), peft.LoraConfig(r=4, target_modules="all-linear", exclude_modules=["layer"]))
    assert {t.hf_module.rsplit(".", 1)[-1] for t in plan.targets} == {"kv_proj"} and len(plan.targets) == 4
    plan = plan_lora(_bridge(), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert sorted({(t.hf_module.split(".", 3)[-1], t.kind, t.own_weight) for t in plan.targets}) == [
        ("mlp.router.layer", "router", None), ("self_attention.experts.router.layer", "replicated", "router"),
        ("self_attention.kv_proj", "column", None)], plan.targets


def test_cached_generate_tp2_sp(two_ranks):
    assert all(res["generate"] == {"greedy": True, "beams": True} for res in two_ranks), two_ranks[0]["generate"]


def test_export_round_trip_tp2_sp_ep2(two_ranks):
    assert all(res["round_trip"] for res in two_ranks)


def _bridge(**overrides):
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    return get_bridge(_config("jetmoe", architectures=["JetMoeForCausalLM"], **overrides))


def test_fields_refused():
    """A non-silu activation is refused by name; ``output_router_logits`` in the config is accepted."""
    from loongforge_hf.bridges import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match="activation_function='gelu'"):
        _bridge(activation_function="gelu")
    assert _bridge(output_router_logits=True).routers_per_layer == 2


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
