"""LoRA on megatron parallel layers against PEFT on the transformers model.

- Initial adapters: the same tensors as ``peft.get_peft_model`` after the same seed (bit for bit), for several
  LoraConfigs (all-linear, lists, regex, layers_to_transform, exclude_modules, gaussian / no init, rsLoRA,
  rank_pattern / alpha_pattern by suffix, full name and regex).
- TP=2 (with and without sequence parallelism) layer math: outputs and gradients against plain torch.
- Whole model, TP=2, PP=2 and CP=2 (and TP=2 + SP and PP=2 with per-module ranks and alphas): logits, loss and
  adapter gradients against PEFT; megatron's DDP/optimizer hold only
  the adapters (and modules_to_save); the adapter folder loads in ``PeftModel.from_pretrained`` and the merged
  export in transformers, both giving the Loong model's logits; merged export leaves the model as it was.
- EXAONE 3 (PEFT's Llama names, the checkpoint's GPT-2-style ones) at TP=2 + SP in the same world: logits, loss,
  adapter gradients, the adapter folder and the merged export.
- Qwen3.5's linear-attention in-projections and gated q / k / v, AFMoE's q / k / v (its gates a tensor of their
  own) and Granite 4.0 H's Mamba2 ``in_proj`` are targets; each in-projection's B rows land in its slot of the
  loaded megatron weight at TP1 / TP2 (pure; the models against PEFT run in tests/bridges/test_qwen3_5.py,
  test_olmo_hybrid.py and tests/integrations/test_lora_new_bridges.py).
"""

from __future__ import annotations

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_checks import PATTERN_KW, tp2_and_pp2_checks

INIT_CASES = {
    "all_linear": ("llama", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    "list_layers_gaussian": ("qwen3", dict(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj", "v_proj"],
                                           layers_to_transform=[1, 3], init_lora_weights="gaussian")),
    "regex_no_init_rslora": ("qwen2", dict(r=3, lora_alpha=5, target_modules=r".*\.(k_proj|up_proj|o_proj)",
                                           init_lora_weights=False, use_rslora=True)),
    "exclude": ("llama", dict(r=2, target_modules=["gate_proj", "o_proj"],
                              exclude_modules=["model.layers.0.mlp.gate_proj"])),
    "patterns": ("llama", PATTERN_KW),
    "orthogonal": ("qwen2", dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights="orthogonal",
                                 rank_pattern={"o_proj": 2})),
    "phi3_packed": ("phi3", dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"gate_up_proj": 2})),
    "patterns_rslora": ("qwen3", dict(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], use_rslora=True,
                                      rank_pattern={r"layers\.[02]\.self_attn\.q_proj": 6},
                                      alpha_pattern={"down_proj": 1})),
    # NOTE: GPT-2's Conv1D linears (weights stored [in, out]): A [r, in], B [out, r] as for nn.Linear
    "gpt2_conv1d": ("gpt2", dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"mlp.c_proj": 2})),
    # NOTE: EXAONE 3: PEFT's Llama names on a checkpoint named transformer.h.N.attn.attention.* (bridge's
    # checkpoint_name)
    "exaone_renamed": ("exaone", dict(r=4, lora_alpha=8, target_modules="all-linear")),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-src")
    return {arch: make_tiny_checkpoint(base / arch, arch)
            for arch in ("llama", "qwen2", "qwen3", "phi3", "gpt2", "exaone", "granitemoehybrid", "qwen3_5",
                         "qwen3_next", "olmo_hybrid", "afmoe", "diffllama")}


@pytest.mark.parametrize("case", list(INIT_CASES))
def test_initial_adapters_are_peft_s(checkpoints, case):
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora.init import draw_initial_weights
    from loongforge_hf.lora.plan import plan_lora

    arch, kw = INIT_CASES[case]
    folder = checkpoints[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(3)
    ref = peft.get_peft_model(hf, peft.LoraConfig(**kw))
    plan = plan_lora(get_bridge(transformers.AutoConfig.from_pretrained(folder)), peft.LoraConfig(**kw))
    transformers.set_seed(3)
    drawn = draw_initial_weights(plan.targets, kw.get("init_lora_weights", True))

    expected = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
                for n, _ in ref.named_parameters() if n.endswith("lora_A.default.weight")}
    assert [t.hf_module for t in plan.targets] == [n for n, _ in hf.named_modules() if n in expected]
    params = dict(ref.named_parameters())
    for t, (a, b) in zip(plan.targets, drawn):
        assert torch.equal(a, params[f"base_model.model.{t.hf_module}.lora_A.default.weight"]), t.hf_module
        assert torch.equal(b, params[f"base_model.model.{t.hf_module}.lora_B.default.weight"]), t.hf_module
        assert t.scaling == pytest.approx(ref.get_submodule(f"base_model.model.{t.hf_module}").scaling["default"])
    if kw["target_modules"] == "all-linear":
        assert plan.target_modules == sorted(ref.peft_config["default"].target_modules)


@pytest.mark.parametrize("kw, match", [
    (dict(target_modules=["norm"]), "cannot carry a LoRA adapter"),
    (dict(target_modules=["embed_tokens"], use_dora=True), "use_dora=True with LoRA on the token embedding"),
    (dict(target_modules=["nothing_like_this"]), "match no module"),
    (dict(target_modules=["q_proj"], modules_to_save=["k_proj"]), "modules_to_save"),
    (dict(target_modules=["q_proj"], init_lora_weights="eva"), "init_lora_weights"),
    (dict(target_modules=["q_proj"], lora_bias=True), "lora_bias"),
])
def test_unsupported_configs_are_refused(checkpoints, kw, match):
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(checkpoints["llama"]))
    with pytest.raises(LoraConfigError, match=match):
        plan_lora(bridge, peft.LoraConfig(**kw))


@pytest.mark.parametrize("kw, match", [
    (dict(target_modules=["c_attn"], modules_to_save=["wte"]), "tied to the LM head"),
    (dict(target_modules=["c_attn"], modules_to_save=["lm_head"]), "embedding's own weight"),
    (dict(target_modules=["c_attn"], modules_to_save=["c_fc"]), "cannot be trained whole"),
    (dict(target_modules=["lm_head"]), r"cannot carry a LoRA adapter.*'c_attn', 'c_fc', 'c_proj'"),
])
def test_gpt2_unsupported_configs_are_refused(checkpoints, kw, match):
    """GPT-2: the embedding (tied to the LM head) and its Conv1D linears cannot be trained whole; the LM head is no
    LoRA target (the message lists the Conv1D modules that are)."""
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(checkpoints["gpt2"]))
    with pytest.raises(LoraConfigError, match=match):
        plan_lora(bridge, peft.LoraConfig(**kw))


def test_fused_slots_are_targets(checkpoints):
    """Qwen3.5's linear-attention projections (four HF linears in one megatron ``in_proj``) and gated
    q / k / v are targets ("all-linear" takes every linear but the LM head), DoRA on them refused by name; Granite 4.0
    H's Mamba2 ``in_proj`` (one HF linear of five row sections) is a target as any column-parallel linear."""
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(checkpoints["qwen3_5"]))
    slots = ["in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "k_proj", "q_proj", "v_proj"]
    plan = plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear"))
    others = ["down_proj", "gate_proj", "o_proj", "out_proj", "up_proj"]
    assert sorted({t.name for t in plan.targets}) == sorted(slots + others)
    with pytest.raises(LoraConfigError, match=re.escape(f"use_dora=True is not supported on {slots}")):
        plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear", use_dora=True))
    plan = plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear", use_dora=True, exclude_modules=slots))
    assert sorted({t.name for t in plan.targets}) == others
    granite = get_bridge(transformers.AutoConfig.from_pretrained(checkpoints["granitemoehybrid"]))
    plan = plan_lora(granite, peft.LoraConfig(r=2, target_modules="all-linear"))
    assert {t.name for t in plan.targets} == {"in_proj", "input_linear", "k_proj", "o_proj", "out_proj",
                                              "output_linear", "q_proj", "v_proj"}


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "olmo_hybrid", "afmoe", "diffllama"])
def test_unequal_slots_placed_as_the_weight(checkpoints, arch):
    """Pure, TP1 / TP2: each in-projection's B rows (and the gated q_proj's; AFMoE's q / k / v beside its gates'
    own gate_proj; DiffLlama's q / k / v, each rank a slice of both halves of the heads), moved to megatron's order
    and sliced for a rank (``Target.b_to_megatron``, ``model._layout_and_slices``), are that rank's rows of the HF
    weight in its slot of the loaded megatron ``in_proj`` / ``linear_qkv``, and ``b_to_hf`` takes them back."""
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.bridges.diffllama import HalvesQKV
    from loongforge_hf.bridges.gated_mappings import GatedQKV, HeadSections, KeyHeadGroups
    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora.model import _layout_and_slices
    from loongforge_hf.lora.plan import plan_lora

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(checkpoints[arch]))
    plan = plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear"))
    by_module: dict = {}
    for t in plan.targets:
        if isinstance(t.mapping, (GatedQKV, HeadSections, KeyHeadGroups, HalvesQKV)):
            by_module.setdefault((t.layer, t.megatron_module), []).append(t)
    assert (arch in ("afmoe", "diffllama") or any(t.megatron_module.endswith(".in_proj") for t in plan.targets)) and \
        all(len(ts) > 1 for ts in by_module.values())  # NOTE: the in_proj of two, four or six HF linears
    gen = torch.Generator().manual_seed(0)
    for (layer, _), targets in by_module.items():
        mapping = targets[0].mapping
        # NOTE: every HF tensor of the fused weight (AFMoE's gate_proj too, which PEFT's rewrite leaves unadapted)
        weights = {n: torch.randn(plan.hf_shapes[n][0], 3, generator=gen) for n in mapping.hf_names(layer)}

        class Reader:
            def get_slice(self, name, dim, start, stop):
                return weights[name][start:stop]

            def shape(self, name):
                return tuple(weights[name].shape)

            def dtype(self, name):
                return weights[name].dtype
        for tp in (1, 2):
            for rank in range(tp):
                ctx = shard_context(bridge, tp_rank=rank, tp_size=tp, padded_vocab=bridge.hf_config.vocab_size)
                fused, (layout, slices) = mapping.load(Reader(), ctx, layer), _layout_and_slices(targets, ctx, layer)
                for t in targets:
                    w = weights[mapping.hf_names(layer)[t.slot]]
                    assert torch.equal(t.b_to_megatron(w, ctx)[slices[t.name]], layout.slot(fused, t.name)), t
                    assert torch.equal(t.b_to_hf(t.b_to_megatron(w, ctx), ctx), w), t


@pytest.mark.parametrize("arch, given, expected", [("gpt2", False, True), ("gpt2", True, True),
                                                   ("llama", True, False), ("llama", False, False)])
def test_fan_in_fan_out_set_as_peft_sets_it(checkpoints, arch, given, expected):
    """PEFT sets ``fan_in_fan_out`` True on Conv1D targets and False on nn.Linear ones, warning where it changes it;
    the plan's config (what adapter_config.json gets) says the same, the user's config is left as it was."""
    import warnings

    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora.plan import plan_lora

    kw = dict(r=2, target_modules="all-linear", fan_in_fan_out=given)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32)
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        ref = peft.get_peft_model(hf, peft.LoraConfig(**kw))
    config = peft.LoraConfig(**kw)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        plan = plan_lora(get_bridge(transformers.AutoConfig.from_pretrained(checkpoints[arch])), config)
    assert plan.config.fan_in_fan_out is expected is ref.peft_config["default"].fan_in_fan_out
    assert config.fan_in_fan_out is given
    said = [[str(w.message) for w in caught if "fan_in_fan_out" in str(w.message)] for caught in (ours, theirs)]
    assert said[0] == said[1] and len(said[1]) == (given != expected), said


def _other_linear_in_a_target_slot(folder: str) -> dict:
    """A target slot holding a linear LoRA cannot adapt (as TE's linears under fp8_recipe='te_...'), in the second
    layer: refused before the first layer's targets, or any parameter's requires_grad, are changed."""
    import peft
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    class OtherLinear(ColumnParallelLinear):
        pass

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.chunks[0].decoder.layers[1].self_attention.linear_qkv.__class__ = OtherLinear
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    except TypeError as err:
        after = {n: p.requires_grad for n, p in model.named_parameters()}
        return {"error": str(err), "requires_grad_unchanged": before == after,
                "adapters": [n for n, m in model.named_modules() if hasattr(m, "lora")]}
    return {"error": None}


def test_unadaptable_target_refused_before_any_change(checkpoints):
    from loongforge_hf.parallel.spawn import run_distributed

    [result] = run_distributed(_other_linear_in_a_target_slot, 1, str(checkpoints["llama"]), timeout=300)
    assert result["error"] and "OtherLinear" in result["error"] and "Transformer Engine" in result["error"], result
    assert result["requires_grad_unchanged"] and result["adapters"] == [], result


def _lora_under_local_graphs(folder: str) -> dict:
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    out = {}
    for graphs in (False, True):
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if graphs:
            model.megatron.config.cuda_graph_impl = "local"  # NOTE: as megatron_config gives it on a GPU
        torch.manual_seed(0)
        model = get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=4, init_lora_weights=False))
        model.train()
        seen = []
        model.chunks[0].decoder.layers[0].register_forward_pre_hook(
            lambda m, a, k: seen.append(k["hidden_states"].requires_grad), with_kwargs=True)
        model(input_ids=ids, labels=ids).loss.backward()
        out[graphs] = {"first_input_requires_grad": seen,
                       "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}}
        # recomputation asks for the same hook for its own reason; switching it off leaves the graphs' one
        model.activation_checkpointing_enable()
        model.activation_checkpointing_disable()
        seen.clear()
        model(input_ids=ids, labels=ids)
        out[graphs]["after_recompute_off"] = seen
    return out


def test_lora_under_local_cuda_graphs_feeds_the_first_layer_an_input_with_grad(checkpoints):
    """megatron's local CUDA graphs take each graphed layer's gradient with respect to its inputs that require grad
    and fail where none does: with adapters (embedding frozen) the first decoder layer's input then requires grad
    (``LoongModelForCausalLM.embedding_output_requires_grad``), and the adapters' gradients stay exactly those
    without graphs; recomputation switched off again leaves the graphs' reason standing."""
    from loongforge_hf.parallel.spawn import run_distributed

    [result] = run_distributed(_lora_under_local_graphs, 1, str(checkpoints["llama"]), timeout=300)
    assert result[False]["first_input_requires_grad"] == [False], result[False]["first_input_requires_grad"]
    assert result[True]["first_input_requires_grad"] == [True], result[True]["first_input_requires_grad"]
    assert result[False]["after_recompute_off"] == [False] and result[True]["after_recompute_off"] == [True]
    plain, graphed = result[False]["grads"], result[True]["grads"]
    assert plain.keys() == graphed.keys() and len(plain) > 0
    for name, grad in plain.items():
        assert grad.abs().sum() > 0 and torch.equal(graphed[name], grad), name


@pytest.fixture(scope="module")
def two_rank_results(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-out")
    return run_distributed(tp2_and_pp2_checks, 2, str(checkpoints["llama"]), str(out), str(checkpoints["exaone"]),
                           timeout=400)


def test_tp2_layer_math_matches_torch(two_rank_results):
    for r in two_rank_results:
        assert r["layers"] == ["column_qkv_sp0", "row_sp0", "column_qkv_sp1", "row_sp1"]


def test_exaone_renamed_checkpoint_matches_peft(two_rank_results):
    """EXAONE 3 at TP=2 + SP: PEFT's Llama-named targets on its GPT-2-style checkpoint names; logits, loss and layer 1's
    adapter gradients are asserted inside the ranks (1e-5), each adapter's megatron slot named as the checkpoint's
    linear; the adapter folder in PEFT and the merged export in transformers give the same logits."""
    rank0 = two_rank_results[0]["exaone_tp2_sp"]
    layer = "model.layers.1"
    assert rank0["compared"] == [f"{layer}.self_attn.q_proj:q_proj", f"{layer}.self_attn.v_proj:v_proj",
                                 f"{layer}.self_attn.o_proj:out_proj", f"{layer}.mlp.gate_proj:c_fc_0",
                                 f"{layer}.mlp.up_proj:c_fc_1", f"{layer}.mlp.down_proj:c_proj"]
    assert rank0["adapter_logits_diff"] < 1e-5 and rank0["merged_logits_diff"] < 1e-5, rank0
    assert all(r["exaone_tp2_sp"]["unchanged_after_merged_export"] for r in two_rank_results)


def test_unseeded_ranks_start_from_rank0s_adapters(two_rank_results):
    """get_peft_model at TP2 with the ranks' generators apart (a script that never seeds, or draws on one rank):
    every replicated factor (A of a column-parallel target, B of a row-parallel one) is one tensor on both ranks
    (they were each rank's own draw: the model was no adapter PEFT could load, and a resume changed it), and the
    adapter folder is PEFT's draw from rank 0's generator state, bit for bit."""
    for r in two_rank_results:
        res = r["unseeded"]
        assert res["differ"] == [] and len(res["replicated"]) == 4 * 7, res
    rank0 = two_rank_results[0]["unseeded"]
    assert rank0["keys"] and rank0["max_diff"] == 0.0, rank0


@pytest.mark.parametrize("layout", ["dropout", "dropout_sp", "dora_dropout_sp"])
def test_dropout_keeps_tp_replicas_in_step(two_rank_results, layout):
    """Replicated adapter factors get equal gradients on both TP ranks with lora_dropout > 0 (compared in-rank; DoRA:
    its dropout path multiplies W by the dropped input again, and a row-parallel magnitude is replicated)."""
    names = two_rank_results[0][layout]
    assert any(n.endswith(".A") and "linear_qkv" in n for n in names)     # column-parallel: A replicated
    assert any(n.endswith(".B") and "linear_fc2" in n for n in names)     # row-parallel: B replicated
    if layout.startswith("dora"):
        assert any(n.endswith(".magnitude") and "linear_proj" in n for n in names)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "cp2", "tp2_sp_patterns", "pp2_patterns"])
def test_model_matches_peft(two_rank_results, layout):
    """Logits, loss and (TP2, CP2) adapter gradients are asserted inside the ranks; exports are checked on rank 0."""
    import peft  # noqa: F401 - the ranks need it; fail here with a clear import error otherwise

    rank0 = two_rank_results[0][layout]
    assert rank0["counts"] == rank0["peft_counts"]
    assert rank0["adapter_logits_diff"] < 1e-4
    assert rank0["merged_logits_diff"] < 1e-4
    for r in two_rank_results:
        res = r[layout]
        assert res["ddp_holds_trainable_only"]
        assert res["optimizer_numel"][0] == res["optimizer_numel"][1] > 0
        assert res["frozen_tensors"] > 0
        assert res["unchanged_after_merged_export"]


def test_orthogonal_init_needs_an_even_rank(checkpoints):
    """As PEFT (which raises ValueError for an odd rank): refused before any adapter exists."""
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.init import draw_initial_weights
    from loongforge_hf.lora.plan import plan_lora

    config = peft.LoraConfig(r=3, target_modules=["q_proj"], init_lora_weights="orthogonal")
    plan = plan_lora(get_bridge(transformers.AutoConfig.from_pretrained(checkpoints["llama"])), config)
    with pytest.raises(LoraConfigError, match="orthogonal' needs an even rank"):
        draw_initial_weights(plan.targets, config.init_lora_weights)
