"""HY-V4 (``bridges/hy_v4.py``) against transformers' ``HYV4ForCausalLM`` on a tiny fp32 checkpoint: multi-latent
attention with DeepSeek Sparse Attention (each query keeps 4 of up to 12 keys; layers 1 and 3 reuse an earlier
top-k), sinks and an output gate, 3 hyper-connection streams, a dense first layer then experts with a SwiGLU limit
that clips. Logits and loss within 1e-4 and ``router_logits`` within 1e-5 at TP1, TP2 + SP, EP2 and PP2 (the streams
cross the stages; each shared layer reads a full layer's top-k on its own stage); at PP2 also LoongTrainer's first
step (loss within 1e-4, gradient norm within 1e-4 relative, every gradient within 1e-4 of its largest entry),
activation recompute refused by name (a recomputed shared layer would read another micro-batch's top-k), and a
pipeline split with a shared layer opening a stage refused by name (pure check); at TP1 also a left-padded row, a row
of two documents (``position_ids`` restarting: each as transformers runs it alone) and a checkpoint naming the MLPs'
gates ``gate_proj`` with a ``model.mtp_layers.*`` tensor (read as transformers reads it, exported under the names it
writes, the tensor passed through); at TP1 and TP2 + SP greedy generate and a 2-beam search of left-padded prompts
longer than ``index_topk`` with the KV cache (the sinks and gate through the cached steps, each full layer's rotated
indexer keys cached) token for token transformers' with its cache (each step's logits within 1e-4) and ours without,
the static cache refused by name; every gradient at TP2 + SP within 1e-4 of its largest entry (the frozen indexer's
tensors take none, as in transformers); bit-exact export at TP2 + SP, EP2 and PP2; LoRA against PEFT
(``"all-linear"`` but the indexer, the routed experts' stacks and the router as ``target_parameters``,
``init_lora_weights=False``)
at TP1 and TP2 + SP x EP2: logits and loss within 1e-4,
every adapter's gradient within 1e-4 of its largest entry, the adapter folder in PEFT and the merged export in
transformers (logits within 1e-4), at TP2 + SP x EP2 the folder loaded onto a fresh model and ``unload()``; the norms in
``modules_to_save``, the indexer's ``k_norm`` stays frozen and every trainable tensor takes a gradient (what
LoongSFTTrainer's overlapped gradient reduction needs). In the same world A.X-K2's gated ``q_gate_proj`` and ``o_proj``
with LoRA and its gated norms saved, against PEFT at TP1 and TP2 + SP. One two-rank world runs it all;
the config, layout and LoRA refusals are pure."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

LAYOUTS = {"tp1": {}, "tp2sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
           "ep2": {"expert_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2},
           "cp2": {"context_parallel_size": 2}}
# NOTE: LoRA on the routed experts takes them whole on each rank (expert_tensor_parallel_size=1)
LORA_LAYOUTS = {"tp1": {}, "tp2sp_ep2": {"tensor_parallel_size": 2, "sequence_parallel": True,
                                         "expert_parallel_size": 2, "expert_tensor_parallel_size": 1}}


def _generate(model, ref) -> dict:
    """Greedy and 2-beam generate with the KV cache (``_moe_parity._dsa_generate``: prompts of 6 and 9 tokens, left
    padded, longer than ``index_topk``) and the static cache's refusal."""
    from tests.bridges._moe_parity import _dsa_generate

    try:
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False,
                       cache_implementation="static")
        refusal = ""
    except Exception as err:  # noqa: BLE001 - the test reads the message
        refusal = str(err)
    return {"generate": _dsa_generate(model, ref), "static_refusal": refusal}


def _padded_and_packed(model, ref, ids: torch.Tensor) -> dict:
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        theirs = ref(input_ids=ids, attention_mask=mask).logits
    packed = torch.cat([torch.arange(7), torch.arange(5)]).expand(2, -1)
    with torch.no_grad():
        docs = model(input_ids=ids, position_ids=packed).logits
        apart = torch.cat([ref(input_ids=ids[:, :7]).logits, ref(input_ids=ids[:, 7:]).logits], dim=1)
    return {"padded": (ours - theirs)[mask.bool()].abs().max().item(), "packed": (docs - apart).abs().max().item()}


def _hub_named(folder: Path) -> Path:
    """``folder`` with the MLPs' gates under ``gate_proj`` and a ``model.mtp_layers.*`` tensor, in one file."""
    import shutil

    from safetensors.torch import load_file, save_file

    hub = folder.with_name("hub")
    shutil.copytree(folder, hub)
    tensors = {"model.mtp_layers.0.norm.weight": torch.ones(64)}
    for f in hub.glob("model*.safetensors*"):
        if f.suffix == ".safetensors":
            tensors.update({re.sub(r"(\.mlp(?:\.shared_experts)?)\.linear_gate\.", r"\1.gate_proj.", k): v
                            for k, v in load_file(f).items()})
        f.unlink()
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    return hub


def _hub_checks(folder: str, hub: str, ref, ids: torch.Tensor) -> dict:
    import torch.distributed as dist

    import loongforge_hf as lf
    from tests.bridges.test_deepseek_v4 import _exported_equal

    model = lf.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    model.save_pretrained(f"{hub}-out{dist.get_rank()}")
    return {"hub_logits": diff, "hub_export": _exported_equal(
        folder, f"{hub}-out{dist.get_rank()}", extra=("model.mtp_layers.0.norm.weight",))}


def _axk2_lora(folder: str) -> dict:
    """A.X-K2's gated query up-projection (q_gate_proj) and o_proj (its output gate a pre-hook on linear_proj, as
    HY-V4's) with LoRA, the gated norms saved, against PEFT at TP1 and TP2 + SP (``lora_checks``: logits, loss, every
    adapter's gradient, the adapter folder in PEFT, the merged export in transformers; at TP2 + SP the folder
    loaded onto a fresh model and ``unload()``), the saved norms scaled before the folder is written."""
    from tests.bridges.test_deepseek_v4 import lora_checks

    return {name: lora_checks(folder, f"axk2-{name}", LAYOUTS[name], AXK2_LORA_KW, name != "tp1", scale_saved=1.25)
            for name in ("tp1", "tp2sp")}


def _world(folder: str, hub: str, axk2: str) -> dict:
    import torch.distributed as dist

    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_models import hf_causal_lm
    from tests.bridges.test_deepseek_v4 import _exported_equal, _gradients, _pipeline_step, lora_checks

    out, ref = {}, hf_causal_lm(folder, dtype=torch.float32)
    ids = torch.randint(3, 203, (2, 12), generator=torch.Generator().manual_seed(7))
    for name, layout in LAYOUTS.items():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        with torch.no_grad():
            ours = model(input_ids=ids, labels=ids, output_router_logits=True)
            theirs = ref(input_ids=ids, labels=ids, output_router_logits=True)
        out[name] = {"logits": (ours.logits - theirs.logits).abs().max().item(),
                     "loss": abs(ours.loss.item() - theirs.loss.item()),
                     "router_counts": (len(ours.router_logits), len(theirs.router_logits)),
                     "router": max((a - b).abs().max().item() for a, b in zip(ours.router_logits,
                                                                              theirs.router_logits))}
        if name in ("tp1", "tp2sp", "cp2"):
            out[name].update(_generate(model, ref))
        if name == "tp1":
            out.update(_padded_and_packed(model, ref, ids))
            out.update(_hub_checks(folder, hub, ref, ids))
        else:
            model.save_pretrained(f"{folder}-{name}")
            dist.barrier()
            out[f"{name}_export"] = _exported_equal(folder, f"{folder}-{name}")
        if name in ("tp2sp", "cp2"):
            out[f"grads_{name}"] = _gradients(model, folder, ids, tag=name)
        if name == "pp2":
            out["pp2_step"] = _pipeline_step(model, folder, ids)
        del model
    for name, layout in LORA_LAYOUTS.items():
        out[f"lora_{name}"] = lora_checks(folder, name, layout, LORA_KW, name != "tp1")
    out["axk2_lora"] = _axk2_lora(axk2)
    return out


# NOTE: init_lora_weights=False keeps B random, so every adapter moves the logits; the indexer's linears are refused,
# its k_norm (a modules_to_save "norm" reaches it) stays frozen
LORA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["wq_b", "wk", "weights_proj"],
               init_lora_weights=False, modules_to_save=["norm"],
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"])
AXK2_LORA_KW = dict(r=4, lora_alpha=8, target_modules=["q_gate_proj", "o_proj"], init_lora_weights=False,
                    modules_to_save=["input_layernorm", "post_attention_layernorm"])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("hy_v4")
    folder, axk2 = make_tiny_checkpoint(root / "hy_v4", "hy_v4"), make_tiny_checkpoint(root / "axk2", "axk2")
    return run_distributed(_world, 2, str(folder), str(_hub_named(folder)), str(axk2), timeout=400)[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_loss_and_router_logits_match_transformers(results, layout):
    r = results[layout]
    assert r["logits"] < 1e-4 and r["loss"] < 1e-4, r
    assert r["router_counts"] == (3, 3) and r["router"] < 1e-5, r


@pytest.mark.parametrize("layout", ["tp2sp", "cp2"])
def test_gradients_match_transformers(results, layout):
    diffs = results[f"grads_{layout}"]
    assert diffs and max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


def test_left_padding_and_packed_rows_match_transformers(results):
    assert results["padded"] < 1e-4 and results["packed"] < 1e-4, results


@pytest.mark.parametrize("layout", ["tp1", "tp2sp", "cp2"])
def test_generate_with_kv_cache_matches_transformers(results, layout):
    """Greedy and 2 beams give transformers' tokens (with its cache) and ours without, each step's logits within
    1e-4 of its cached ones (a cached step without the sinks is 5e-3 off, one rotating the index keys from slot 0
    0.16); every layer caches its heads' keys (4 / TP), the full layers 0 and 2 their indexer's; the static cache is
    refused by name. At CP2 the prompt runs split over the CP ranks and fills the whole cache on each
    (``cp_kv_cache="replicated"``); the default sharded cache is refused by name."""
    g, heads = results[layout]["generate"], 4 // (2 if layout == "tp2sp" else 1)
    assert g["greedy"] == g["beams"] == {"transformers": True, "uncached": True}, g
    assert g["logit_diff"] < 1e-4, g
    assert g["cache_layers"] == [("SparseAttentionCacheLayer", (2, heads, 14, 24), (2, 14, 16) if i in (0, 2) else None)
                                 for i in range(4)], g
    assert "cache_implementation='static' is not supported for HYV4ForCausalLM" in results[layout]["static_refusal"]
    if layout == "cp2":
        assert "cp_kv_cache='sharded' is not supported for HYV4ForCausalLM" in g["sharded_refusal"], g


def test_hub_gate_names_load_and_export_as_transformers_writes(results):
    assert results["hub_logits"] < 1e-4 and results["hub_export"] == {"same_names": True, "unequal": []}, results


def test_trainer_step_and_gradients_through_pipeline_stages_match_transformers(results):
    """PP2 (layers 0-1 | 2-3: each shared layer reads the top-k of the full layer before it on its stage)."""
    r = results["pp2_step"]
    assert "activation recompute with pipeline_parallel_size=2 is not supported for HYV4ForCausalLM with shared " \
        "indexer layers [1, 3]" in r["recompute_refusal"], r["recompute_refusal"]
    assert r["loss"] < 1e-4 and r["grad_norm"] < 1e-4, r
    assert r["grads"] and max(r["grads"].values()) < 1e-4, sorted(r["grads"].items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("layout", ["tp2sp", "ep2", "pp2", "cp2"])
def test_export_is_bit_exact(results, layout):
    assert results[f"{layout}_export"] == {"same_names": True, "unequal": []}


def test_top_k_and_sinks_change_the_tiny_models_logits():
    """At 12 tokens the index top-k (4) binds, and the sinks move the logits: neither is idle in the parity above."""
    import transformers

    from loongforge_hf.testing.tiny_hy_v4 import randomize
    from loongforge_hf.testing.tiny_models import _config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("hy_v4"), dtype=torch.float32).eval()
    randomize(model)
    ids = torch.randint(3, 203, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        base = model(ids).logits
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = 12
        dense = model(ids).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        sinkless = model(ids).logits
    assert (base - dense).abs().max() > 1e-3 and (dense - sinkless).abs().max() > 1e-3


@pytest.mark.parametrize("overrides,field", [({"swiglu_limit": 0.0}, "swiglu_limit=0.0"),
                                             ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
                                             ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
                                             ({"indexer_types": ["shared", "full", "full", "full"]},
                                              "indexer_types=")])
def test_fields_not_reproduced_refused_by_name(overrides, field):
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.testing.tiny_models import _config

    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        get_bridge(_config("hy_v4", **overrides))


def test_layouts_and_lora_refused_by_the_pure_checks(monkeypatch):
    import peft

    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora
    from loongforge_hf.parallel.config import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("hy_v4"))  # NOTE: indexer_types full, shared, full, shared
    # NOTE: a shared layer opening a stage (its top-k on an earlier one): layer 1 at PP2 x VPP2 (one layer a
    # stage), layer 2 at PP2 of full, full, shared, shared
    for bridge_of, layout, field in (
            (bridge, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2},
             r"pipeline_parallel_size=2 .*HYV4ForCausalLM with shared indexer layers \[1, 3\] opening"),
            (get_bridge(_config("hy_v4", indexer_types=["full", "full", "shared", "shared"])),
             {"pipeline_parallel_size": 2}, r"HYV4ForCausalLM with shared indexer layers \[2\] opening")):
        with pytest.raises(UnsupportedConfigError, match=field):
            bridge_of.check_layout(ParallelConfig(**layout))
    bridge.check_layout(ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2, sequence_parallel=True))
    bridge.check_layout(ParallelConfig(pipeline_parallel_size=2))  # NOTE: each stage opens with a full layer
    bridge.check_layout(ParallelConfig(context_parallel_size=2))
    # NOTE: the indexer's refusal: tests/integrations/test_lora_refused_by_name.py; the routed parameters are planned
    # on the MoE layers only (layer 0 is dense), under the grouped MLP only
    routed = peft.LoraConfig(r=4, target_parameters=LORA_KW["target_parameters"])
    assert sorted((t.layer, t.kind, t.slot_name) for t in plan_lora(bridge, routed).targets) == sorted(
        (layer, kind, slot) for layer in (1, 2, 3) for kind, slot in (("experts", "gate_up_proj"),
                                                                      ("experts", "down_proj"), ("router", "router")))
    monkeypatch.setenv("LOONGFORGE_MOE_GROUPED_GEMM", "0")  # NOTE: megatron's SequentialMLP
    with pytest.raises(LoraConfigError, match="LoRA on the routed experts needs loongforge's grouped expert MLP"):
        plan_lora(get_bridge(_config("hy_v4")), routed)


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_matches_peft_and_exports(results, name):
    """'all-linear' but the indexer: MLA's linears, the output gate (gate_proj), o_proj (the gate applied to its
    input by a pre-hook, so megatron's linear takes the adapter), the dense MLP and the shared experts; the routed
    experts' stacks (target_parameters: the grouped MLP's clamped SwiGLU, whole experts per EP rank) and the router;
    the norms
    saved, the indexer's k_norm among them frozen, so every trainable tensor takes a gradient (LoongSFTTrainer's
    overlapped gradient reduction failed on megatron's per_param_grad_ready_counts assertion without it)."""
    r = results[f"lora_{name}"]
    assert r["inspected"]["no_gradient"] == [], r
    assert sum(".indexer.k_norm." in n for n in r["inspected"]["frozen"]) == 4, r
    assert r["logits"] < 1e-4 and r["loss"] < 1e-4 and r["grads"] < 1e-4, r
    # NOTE: 3 MoE layers x (2 stacks + the router) x A / B more (PEFT's names end in experts, experts.base_layer
    # and gate)
    assert r["graded"] == 90 and r["targets"] == ["base_layer", "down_proj", "experts", "gate", "gate_proj",
                                                  "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj",
                                                  "up_proj"], r
    assert r["adapter_logits"] < 1e-4 and r["inspected"]["merged_logits"] < 1e-4, r
    if name != "tp1":  # NOTE: the folder loaded onto a fresh model split over TP, then unloaded
        assert r["reloaded_logits"] < 1e-4 and r["unloaded_logits"] < 1e-4, r


@pytest.mark.parametrize("layout", ["tp1", "tp2sp"])
def test_axk2_gated_projections_lora_matches_peft(results, layout):
    """A.X-K2's q_gate_proj (``q_b_proj`` on disk; each head's query and output-gate rows, the adapter's term added
    before megatron's up-projection splits them) and gated o_proj (the gate a pre-hook on megatron's linear_proj, the
    adapter reading the gated input as PEFT's) with LoRA, the gated norms (``W_down`` / ``W_up`` on disk,
    ``mlp.fc1`` / ``mlp.fc2`` in transformers' tree; the MoE layers' post-attention norms, the dense layers' plain)
    saved: logits and loss within 1e-4, every adapter's gradient within 1e-4 of its largest entry, the adapter
    folder in PEFT with the saved norms scaled by 1.25 (which moves the logits) and the merged export in
    transformers: logits within 1e-4; at TP2 + SP the folder read back onto a fresh model (within 1e-4 of PEFT's) and
    unloaded (transformers' logits)."""
    r = results["axk2_lora"][layout]
    assert r["targets"] == ["o_proj", "q_gate_proj"] and r["graded"] == 16, r
    assert r["logits"] < 1e-4 and r["loss"] < 1e-4 and r["grads"] < 1e-4, r
    assert r["saved_moved"] > 1e-2 and r["adapter_logits"] < 1e-4 and r["inspected"]["merged_logits"] < 1e-4, r
    assert r["inspected"]["no_gradient"] == [], r
    if layout != "tp1":
        assert r["reloaded_logits"] < 1e-4 and r["unloaded_logits"] < 1e-4, r
