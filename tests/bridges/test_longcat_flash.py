"""LongCat-Flash (LongcatFlashForCausalLM: two sublayers per layer with a shortcut MoE, zero experts, scaled MLA
latents), fp32 against transformers within 1e-4, in one world of two ranks: layouts TP1 (DP2), TP2 + SP and EP2, each
with two rows of 40 tokens, the second left-padded by 5 (logits at the real tokens, loss) and transformers'
``router_logits`` (``[tokens, experts + zero experts]``, fp32, every layer); at TP2 + SP greedy and 2-beam cached
generate of a left-padded batch (transformers' tokens) and every parameter's gradient (exported through the bridge,
against transformers', relative to each tensor's largest); a bit-exact export round trip from EP2 (the zero experts'
unused rows passed through); a bf16 checkpoint at TP1 (logits, loss against transformers in bf16, round trip).
LoRA against PEFT at TP1, TP2 + SP (experts whole) and EP2: MLA's projections of both sublayers and the routed experts'
``down_proj`` (logits, loss, every adapter's gradient, the adapter folder in PEFT). Refused fields and layouts, LoRA
targets, the sublayer names, the routing and the filled routing map are checked on the bridge alone (pure, before any
collective)."""

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
# LoRA as PEFT adapts it: MLA's projections of both sublayers and the routed experts' down_proj (init_lora_weights=False
# keeps B random, so every adapter moves the logits)
LORA_KW = dict(r=4, lora_alpha=8, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
               target_parameters=["mlp.experts.down_proj"], init_lora_weights=False)
LORA_LAYOUTS = {"tp1": {}, "tp2_sp": dict(tensor_parallel_size=2, sequence_parallel=True,
                                          expert_tensor_parallel_size=1), "ep2": dict(expert_parallel_size=2)}
BF16_TOL = {"logits": 0.1, "loss": 0.02}  # NOTE: test_moe_parity's for bf16 checkpoints
LAYOUTS = {"tp1": {}, "tp2_sp": dict(tensor_parallel_size=2, sequence_parallel=True),
           "ep2": dict(expert_parallel_size=2)}


def _router_diff(ours, ref) -> float:
    from .test_granitemoehybrid import _ids

    ids = _ids((2, 12), seed=3)
    with torch.no_grad():
        got, want = (m(input_ids=ids, output_router_logits=True).router_logits for m in (ours, ref))
    assert len(got) == len(want) == 2 and all(g.shape == w.shape == (24, 6) for g, w in zip(got, want))
    return max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))


def _gradients(ours, ref, folder: str) -> dict | None:
    """``test_granitemoehybrid._gradients`` (rank 0: every HF tensor's gradient, relative to its largest) where the
    fused ``gate_up_proj`` is compared on its real experts' rows (the zero experts' rows, unused, pass through)."""
    import torch.distributed as dist
    import transformers

    from ._gradients import save_gradients
    from .test_granitemoehybrid import _ids

    ids = _ids((2, 40), seed=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ours(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    save_gradients(ours, f"{folder}-grads")
    if dist.get_rank() != 0:
        return None
    ref.zero_grad()
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    exported = dict(transformers.AutoModelForCausalLM.from_pretrained(f"{folder}-grads", dtype=torch.float32)
                    .named_parameters())
    real = ref.config.n_routed_experts
    out = {}
    for n, p in ref.named_parameters():
        got, want = exported[n].detach(), p.grad
        if n.endswith("experts.gate_up_proj"):
            assert not want[real:].any()  # NOTE: transformers' zero experts' rows take no gradient either
            got, want = got[:real], want[:real]
        out[n] = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
    return out


def _bf16(folder: str) -> dict:
    """The bf16 checkpoint at TP1: logits and loss against transformers in bf16, and its round trip (the router's
    weight and bias in the model's dtype on disk, as transformers keeps them)."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.round_trip import check_round_trip

    from .test_granitemoehybrid import _ids

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    ids = _ids((2, 12), seed=4)
    with torch.no_grad():
        got, want = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    ours.save_pretrained(f"{folder}-saved")
    check_round_trip(folder, f"{folder}-saved")
    return {"logits": float((got.logits.float() - want.logits.float()).abs().max()),
            "loss": float(abs(got.loss - want.loss)), "dtype": str(ours.dtype)}


def _two_ranks(folder: str, bf16_folder: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.round_trip import check_round_trip

    from ._lora_parity import lora_against_peft
    from .test_jetmoe import _cached_generate, _padded

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {f"lora_{name}": lora_against_peft(folder, f"{folder}-lora-{name}", layout, LORA_KW)
           for name, layout in LORA_LAYOUTS.items()}
    for name, layout in LAYOUTS.items():
        ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        out[name] = {**_padded(ours, ref), "router_logits": _router_diff(ours, ref)}
        if name == "ep2":
            ours.save_pretrained(f"{folder}-saved")  # NOTE: one folder for all ranks (written by the first)
        if name == "tp2_sp":
            out["generate"] = _cached_generate(ours, ref)
            out["grads"] = _gradients(ours, ref, folder)
    check_round_trip(folder, f"{folder}-saved")
    out["round_trip"] = True
    out["bf16"] = _bf16(bf16_folder)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("longcat")
    folder = make_tiny_checkpoint(root / "longcat", "longcat_flash")
    bf16 = make_tiny_checkpoint(root / "longcat_bf16", "longcat_flash", dtype=torch.bfloat16)
    return run_distributed(_two_ranks, 2, str(folder), str(bf16), timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_logits_loss_router_logits(two_ranks, layout):
    for res in two_ranks:
        assert max(res[layout].values()) < TOL, (layout, res[layout])


def test_every_gradient_tp2_sp(two_ranks):
    """Every HF tensor's gradient: both sublayers' MLA (scaled latents), ``mlps.0`` (megatron's shared expert),
    ``mlps.1``, the routed experts, the router's rows of the real and zero experts."""
    grads = two_ranks[0]["grads"]
    assert {"model.layers.1.mlp.router.classifier.weight", "model.layers.0.self_attn.1.kv_a_proj_with_mqa.weight",
            "model.layers.1.mlps.0.down_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= set(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, worst


def test_bf16_checkpoint_tp1(two_ranks):
    for res in two_ranks:
        r = res["bf16"]
        assert r["dtype"] == "torch.bfloat16" and r["logits"] < BF16_TOL["logits"] and r["loss"] < BF16_TOL["loss"], r


def test_cached_generate_tp2_sp(two_ranks):
    """Greedy and 2-beam cached generate of a left-padded batch: transformers' tokens (each sublayer its own cache)."""
    assert all(res["generate"] == {"greedy": True, "beams": True} for res in two_ranks), two_ranks[0]["generate"]


def test_export_round_trip_ep2(two_ranks):
    assert all(res["round_trip"] for res in two_ranks)


def _bridge(**overrides):
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    return get_bridge(_config("longcat_flash", **overrides))


@pytest.mark.parametrize("overrides,field", [
    ({"router_bias": True}, "router_bias=True"), ({"attention_bias": True}, "attention_bias=True"),
    ({"moe_topk": 5}, "moe_topk=5"), ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"qk_head_dim": 20}, "qk_head_dim=20"), ({"head_dim": 16}, "head_dim=16")])
def test_fields_refused(overrides, field):
    from loongforge_hf.bridges import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match=field):
        _bridge(**overrides)


@pytest.mark.parametrize("layout,field", [({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
                                          ({"context_parallel_size": 2}, "context_parallel_size=2"),
                                          ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 without")])
def test_layouts_refused(layout, field):
    from loongforge_hf.bridges import UnsupportedConfigError
    from loongforge_hf.parallel.config import ParallelConfig

    with pytest.raises(UnsupportedConfigError, match=f"{field}.*LongcatFlashForCausalLM"):
        _bridge().check_layout(ParallelConfig(**layout))


def test_sublayers_config_and_names():
    """Four megatron layers for two HF layers, MoE on the even ones with ``mlps.0`` as its shared expert; megatron
    layer 3 is HF layer 1's second sublayer; the zero experts' unused rows and ``model.mtp.*`` pass through."""
    bridge = _bridge()
    kw = bridge.transformer_config_kwargs()
    assert kw["num_layers"] == 4 and kw["moe_layer_freq"] == [1, 0, 1, 0] and kw["num_moe_experts"] == 4
    assert kw["moe_shared_expert_intermediate_size"] == 96 and kw["moe_router_dtype"] == "fp32"
    names = {n for m in bridge.mappings_for_layer(3) for n in m.hf_names(3)}
    assert {"model.layers.1.self_attn.1.q_b_proj.weight", "model.layers.1.input_layernorm.1.weight",
            "model.layers.1.post_attention_layernorm.1.weight", "model.layers.1.mlps.1.gate_proj.weight"} <= names
    shapes = bridge.expected_hf_shapes()
    assert shapes["model.layers.0.mlp.router.classifier.weight"] == (6, 64)
    assert shapes["model.layers.0.mlp.experts.5.up_proj.weight"] == (32, 64)  # NOTE: a zero expert's, passed through
    assert "model.layers.0.mlp.experts.4.down_proj.weight" not in shapes
    [(zero, value)] = bridge.optional_tensors
    assert value == 0.0 and re.search(zero, "model.layers.1.mlp.experts.5.gate_proj.weight")
    assert not re.search(zero, "model.layers.1.mlp.experts.3.up_proj.weight")
    assert bridge.passthrough_names(["model.layers.0.mlp.experts.4.up_proj.weight", "model.mtp.norm.weight",
                                     "model.layers.0.mlp.experts.3.up_proj.weight"]) == [
        "model.layers.0.mlp.experts.4.up_proj.weight", "model.mtp.norm.weight"]


@pytest.mark.parametrize("layout", LORA_LAYOUTS)
def test_lora_matches_peft(two_ranks, layout):
    """LoRA on both sublayers' MLA projections (the query scale applied to ``q_b_proj``'s adapter term too, the KV
    latent's to ``kv_b_proj``'s input) and the routed experts' ``down_proj`` against PEFT on transformers' model:
    logits, loss, every adapter's gradient (relative to its largest) and our adapter folder loaded by PEFT, within
    1e-4."""
    for res in two_ranks:
        r = res[f"lora_{layout}"]
        assert r["targets"] == ["experts", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"], r
        assert r["graded"] == 2 * (5 * 4 + 2) and max(r["logits"], r["loss"], r["grads"]) < TOL, r
    assert two_ranks[0][f"lora_{layout}"]["adapter_logits"] < TOL, two_ranks[0][f"lora_{layout}"]


@pytest.mark.parametrize("lora_kw,named", [
    (dict(target_modules=["gate_proj", "up_proj"]), "model.layers.0.mlp.experts.gate_up_proj is not supported"),
    (dict(target_modules="all-linear"), "model.layers.0.mlp.experts.gate_up_proj is not supported"),
    (dict(target_modules=["q_b_proj", "classifier"]), "classifier: transformers' LongCat-Flash router reads")])
def test_lora_refused_by_name(lora_kw, named):
    """The zero experts' rows in transformers' ``gate_up_proj`` (PEFT's factors span them; PEFT's rewrite brings it
    in for ``gate_proj`` / ``up_proj`` and 'all-linear') and the router's ``classifier`` (whose weight transformers
    reads itself: PEFT's adapter there never acts), by the pure planner."""
    import peft

    from loongforge_hf.lora.plan import LoraConfigError, plan_lora

    with pytest.raises(LoraConfigError, match=re.escape(named)):
        plan_lora(_bridge(), peft.LoraConfig(r=4, **lora_kw))
    plan = plan_lora(_bridge(), peft.LoraConfig(r=4, **{k: v for k, v in LORA_KW.items() if k != "r"}))
    assert [(t.layer, t.kind) for t in plan.targets if t.kind == "experts"] == [(0, "experts"), (2, "experts")]


def test_route_and_filled_map():
    """``route`` is transformers' router on its logits (softmax over real and zero experts, biased choice, scaled
    chosen scores); ``full_map`` gives each token ``topk`` real experts, adding only unchosen ones."""
    import types

    import transformers

    from loongforge_hf.bridges.longcat_flash_layers import full_map, route
    from loongforge_hf.testing.tiny_models import _config

    hf = transformers.models.longcat_flash.modeling_longcat_flash.LongcatFlashTopkRouter(_config("longcat_flash"))
    torch.nn.init.normal_(hf.classifier.weight)
    hf.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    logits, weights, chosen = hf(x)
    probs, routing_map = route(types.SimpleNamespace(expert_bias=hf.e_score_correction_bias), logits, False,
                               topk=3, scale=2.5)
    want = torch.zeros_like(probs).scatter(1, chosen, weights)
    assert torch.equal(probs, want) and torch.equal(routing_map, want > 0)
    assert 0 < int(routing_map[:, 4:].any(-1).sum()) < 16  # NOTE: some tokens choose zero experts, some do not
    unbiased = torch.zeros_like(routing_map).scatter(1, logits.topk(3, dim=-1).indices, True)
    assert not torch.equal(unbiased, routing_map)  # NOTE: the bias changes some choices
    filled = full_map(routing_map[:, :4], 3)
    assert (filled.sum(-1) == 3).all() and (filled | routing_map[:, :4]).equal(filled)
