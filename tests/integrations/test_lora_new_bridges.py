"""LoRA on the 104-bridge release's new bridges against PEFT on transformers' model, one spawned world per layout.

Models: MiniMax (lightning attention's packed ``qkv_proj`` / ``output_gate`` / ``out_proj``, softmax attention, the
routed experts and router through PEFT's rewrite on transformers 5), Granite SWA and Granite-MoE SWA, HyperCLOVAX,
BitNet, DiffLlama, OPT, BioGPT, XGLM, GPT-Neo, CodeGen, Persimmon, GPT-NeoX-Japanese, A.X-K1 (MLA + DeepSeek-V3's
routing), Mamba and Falcon-Mamba (the mixers' ``in_proj`` and ``x_proj``: the latter a parameter of our mixer,
refused before), Mamba2 (``in_proj``), RecurrentGemma (the recurrent blocks'
``linear_x`` / ``linear_y`` / ``linear_out``), Kolibri-1 and Aria's text model (attention, shared
experts), LFM3 (attention with its output gate's ``g_proj``, the short convs' ``in_proj`` / ``out_proj``, MLP),
LaraMini (attention, the Gated DeltaNet's split in-projections over its fused ``in_proj``, the shared expert),
Laguna (``q_proj`` / ``k_proj`` / ``v_proj`` / ``g_proj`` with each layer's heads, ``o_proj``, the dense MLP),
Doge (attention, MLP and the dynamic mask's ``dt_proj``, with ``A`` drawn so that it acts; with ``is_moe`` the
retrieval experts' ``router_gate``: parameters of our modules, refused before), Gemma 3n (attention, MLP and each
layer's AltUp / LAuReL / per-layer linears, replicated torch linears on each rank's tokens: refused before; not
``correction_coefs``, whose weight transformers applies itself in training) and Gemma 4 with per-layer inputs
(``gemma4_per_layer``: its per-layer linears likewise), AFMoE (q / k / v beside the attention gates' own slots in
``linear_qkv``, ``o_proj``, the routed experts and the router ``mlp.router.gate``: ``"all-linear"`` was refused),
PhiMoE (attention, its biased ``o_proj`` included, and the router's weight), Hy3 (attention, dense MLPs, the
shared experts under transformers' name for the checkpoint's ``mlp.shared_mlp``: refused before), Mistral 4 and
Emu3's text model (classes transformers' AutoModelForCausalLM does not map: the planner builds the one their config
names; it failed on the Auto class before), HunYuan-MoE and DBRX (their routers, plain linears, as module targets:
refused before), MiMo-V2-Flash (q / k / v with narrower value heads: refused before), Kimi Linear (the KDA layers'
q / k / v / b slots, the gates' low-rank ``f_a_proj`` / ``g_a_proj`` (replicated) and ``f_b_proj`` / ``g_b_proj`` (split
with the heads): parameters of our mixer, refused before; the MLA layers, MLPs, experts and router); DoRA on DiffLlama
(``diffllama_dora``: the magnitudes placed as B's rows).

Choices:
- PEFT's ``"all-linear"`` (``ALL_LINEAR``) wherever the planner takes it; else the largest set it accepts, stated in
  ``ADAPTERS``: the planner refuses Mamba-1's ``dt_proj`` (transformers reads its weight itself: PEFT's adapter there
  never acts); PEFT refuses the Mamba models' ``out_proj``. The weights our own modules hold as parameters (Mamba-1's
  ``x_proj``, Doge's ``dt_proj`` / ``router_gate``, Kimi Linear's gates) carry their adapters through
  ``lora/own_weights.py``. DiffLlama's q / k / v adapters at TP2 hold each rank's slice of both halves of the heads
  (``HalvesQKV.rows_to_megatron``; logits off by 1.03 with B's rows split as a plain QKV's); CodeGen's ``qkv_proj``
  adapter its heads' rows of the ``mp_num`` blocks (``ShardInterleavedQKV``).
- Each model from ``get_peft_model`` and PEFT's after the same seed (``_lora_checks.lora_pair``): the same initial
  factors (DiffLlama's too: planning builds transformers' module tree under a forked RNG, as its lambdas draw).
- A right-padded batch (a left pad's logits feed the next token's loss in transformers but are nobody's contract),
  labels -100 on the pads.
- Checks at TP1 (``new_bridge_checks``): logits (1e-4 on real tokens), loss (1e-5), every module adapter's A and B
  gradient at HF shape (1e-4 relative to each tensor's largest, as ``_lora_hybrids``) and the expert / router
  adapters' of each MoE layer (``_lora_moe._check_expert_grads``, 1e-5), PEFT's trainable counts, the adapter folder's
  tensor names and shapes equal to the folder PEFT writes for its model, that folder loaded by
  ``PeftModel.from_pretrained`` and the merged export by transformers with our logits (1e-4); with adapters on our
  modules' own weights (Mamba, Falcon-Mamba, Doge, Kimi Linear) ``disable_adapter()`` and ``unload()`` giving PEFT's
  base logits (1e-4), the modules' classes restored; LaraMini's and
  LFM3's merged export under the checkpoint's own tensor names (the fused ``in_proj``, ``gate_proj``).
- The same at TP2 + SP in one 2-rank world (MiniMax with its experts whole on each rank: ``TP2_LAYOUTS``): B's rows
  gathered over TP and put back in the checkpoint's order (``Target.b_to_hf``) before the comparison. No pipeline
  stages, so megatron's layer numbers are the global ones.
"""

from __future__ import annotations

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_doge import DOGE_ARCHS, randomize


ALL_LINEAR = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
ADAPTERS = {
    "minimax": ALL_LINEAR, "granite_swa": ALL_LINEAR, "granitemoe_swa": ALL_LINEAR, "hyperclovax": ALL_LINEAR,
    "bitnet": ALL_LINEAR,
    # NOTE: DiffLlama's q / k / v: B's rows of each rank its slice of both halves of the heads (HalvesQKV)
    "diffllama": ALL_LINEAR,
    "opt": ALL_LINEAR, "gpt_neo": ALL_LINEAR, "biogpt": ALL_LINEAR, "xglm": ALL_LINEAR,
    # NOTE: CodeGen's qkv_proj (mp_num blocks of q / v / k): B's rows in megatron's order as the weight's
    "codegen": ALL_LINEAR, "persimmon": ALL_LINEAR,
    "gpt_neox_japanese": ALL_LINEAR, "axk1": ALL_LINEAR,
    # NOTE: the mixers' out_proj refused by PEFT (its Mamba check), Mamba-1's dt_proj by the planner (transformers
    # reads dt_proj.weight itself, so PEFT's adapter never acts): in_proj, x_proj (our mixer's parameter)
    "mamba": dict(ALL_LINEAR, exclude_modules=["out_proj", "dt_proj"]),
    "falcon_mamba": dict(ALL_LINEAR, exclude_modules=["out_proj", "dt_proj"]),
    "mamba2": dict(ALL_LINEAR, exclude_modules=["out_proj"]),
    # NOTE: PEFT's all-linear takes attention and the shared experts (the routers and stacked experts are no Linear)
    "kolibri1": ALL_LINEAR, "aria_text": ALL_LINEAR,
    # NOTE: Laguna's q / k / v / g_proj (per-layer heads, the gate rows beside the queries), o_proj and the dense MLP;
    # not the shared experts: transformers' rename of their checkpoint name (mlp.shared_expert. -> shared_experts., a
    # regex whose dot takes the "s") garbles PEFT's own adapter keys on PeftModel.from_pretrained
    "laguna": dict(ALL_LINEAR, exclude_modules=r".*\.shared_experts\..*"),
    # NOTE: Gemma 4 Unified's and Cohere Compass's language models (Gemma 4's per-type heads and keys as values;
    # Cohere2's attention and MLP side by side)
    "gemma4_unified": ALL_LINEAR, "cohere_compass": ALL_LINEAR,
    # NOTE: LFM3's attention (q / k / v / o_proj and the output gate's g_proj, gate_proj on disk), conv in_proj /
    # out_proj and MLP
    "lfm3": ALL_LINEAR,
    # NOTE: RecurrentGemma's recurrent blocks' linear_x / linear_y (in_proj's sections) / linear_out, the local
    # attention's q_proj / o_proj, the MLP; not k_proj / v_proj: the one KV head is replicated at TP2, where the planner
    # refuses adapters on its rows
    "recurrent_gemma": dict(ALL_LINEAR, exclude_modules=["k_proj", "v_proj"]),
    # NOTE: Doge's attention, MLP and dt_proj (a parameter of our core attention, split with the KV heads); with
    # is_moe the retrieval experts' router_gate (replicated, on each rank's tokens under SP)
    "doge": ALL_LINEAR, "doge_moe": ALL_LINEAR,
    # NOTE: Gemma 3n's attention (q / k / v; q alone in the layers reusing keys and values), MLP and each layer's
    # AltUp / LAuReL / per-layer linears (torch linears on each rank's tokens: lora/replicated.py); not AltUp's
    # correction_coefs (refused by name: transformers applies its weight itself in training) nor the model's own
    # stream projections outside the layers
    "gemma3n": dict(ALL_LINEAR, exclude_modules=r".*(correction_coefs|altup_projections|altup_unembed_projections|"
                                                r"per_layer_model_projection).*"),
    # NOTE: Gemma 4's per-layer inputs (E2B / E4B's layout): each layer's per_layer_input_gate / per_layer_projection
    # beside attention and MLP; not the model's per_layer_model_projection, outside the layers
    "gemma4_per_layer": dict(ALL_LINEAR, exclude_modules=["per_layer_model_projection"]),
    # NOTE: LaraMini's attention, shared expert and Gated DeltaNet in_proj_qkv / z / b / a (one fused in_proj on
    # disk, the merged export's) and out_proj
    "lara_mini": ALL_LINEAR,
    # NOTE: AFMoE's q / k / v (slots beside its attention gates in linear_qkv) and o_proj, the routed experts and the
    # router (mlp.router.gate) through PEFT's rewrite, which leaves the gates' gate_proj and the dense MLPs out
    "afmoe": ALL_LINEAR,
    # NOTE: PhiMoE's attention (o_proj with its bias: a re-classed megatron linear, which LoRA failed on) and, as its
    # refusal of the router module says, the router's weight as a parameter
    "phimoe": dict(ALL_LINEAR, exclude_modules=["router"], target_parameters=["mlp.router.weight"]),
    # NOTE: Hy3's attention, dense MLPs and shared experts (mlp.shared_mlp on disk: the bridge's checkpoint_name)
    "hy_v3": ALL_LINEAR,
    # NOTE: two models transformers' AutoModelForCausalLM does not map (planned on the class their config names):
    # Mistral 4 (MLA, dense MLPs and shared experts) and Emu3's text model
    "mistral4": ALL_LINEAR, "emu3": ALL_LINEAR,
    # NOTE: routers that are plain linears, adapted as modules (refused before): HunYuan-MoE's gate.wg (fp32, beside
    # its attention and, through PEFT's rewrite, the routed experts) and DBRX's router.layer (beside Wqkv, out_proj)
    "hunyuan_v1_moe": ALL_LINEAR, "dbrx": ALL_LINEAR,
    # NOTE: MiMo-V2-Flash's q / k / v with value heads narrower than the query / key heads (refused before), o_proj,
    # the dense MLP and, as PEFT names no expert stacks here, no experts
    "mimo_v2_flash": ALL_LINEAR,
    # NOTE: DoRA on DiffLlama's q / k / v: the magnitudes' rows, as B's, each rank's slice of both halves of the heads
    "diffllama_dora": dict(ALL_LINEAR, use_dora=True),
    # NOTE: Kimi Linear's KDA gates (f_a_proj / g_a_proj replicated, f_b_proj / g_b_proj split with the heads: our
    # mixer's parameters) beside everything else "all-linear" names
    "kimi_linear": ALL_LINEAR,
}
# NOTE: a case on another architecture's tiny checkpoint, with config fields changed
CHECKPOINT_OF = {"diffllama_dora": ("diffllama", {}),
                 "gemma4_per_layer": ("gemma4", dict(attention_k_eq_v=False, hidden_size_per_layer_input=8,
                                                     vocab_size_per_layer_input=203, num_kv_shared_layers=2))}
TP2_SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
# model -> its two-rank layout: TP2 + SP (MiniMax's, AFMoE's, HunYuan-MoE's and Kimi Linear's routed experts' adapters
# whole on each rank: refused otherwise)
TP2_LAYOUTS = {**{arch: TP2_SP for arch in ADAPTERS}, "minimax": {**TP2_SP, "expert_tensor_parallel_size": 1},
               "afmoe": {**TP2_SP, "expert_tensor_parallel_size": 1},
               "hunyuan_v1_moe": {**TP2_SP, "expert_tensor_parallel_size": 1},
               "kimi_linear": {**TP2_SP, "expert_tensor_parallel_size": 1}}


def _dense_grads(model, ref) -> dict[str, float]:
    """PEFT name of each module adapter factor -> its gradient's difference from PEFT's (relative)."""
    from loongforge_hf.lora.model import PARAM_KINDS

    from ._lora_checks import _gather_full, lora_shard_context
    from ._lora_hybrids import _relative

    ctx, theirs, out = lora_shard_context(model), dict(ref.named_parameters()), {}
    for t in (t for t in model.lora_plan.targets if t.kind not in PARAM_KINDS):
        adapter = model.chunks[0].get_submodule(t.megatron_module.format(layer=t.layer)).lora[t.name]
        a = _gather_full(_token_sum(adapter.A), 1 if t.kind == "row" else None)
        b = _token_sum(adapter.B) if t.kind in ("row", "replicated") else \
            t.b_to_hf(_gather_full(adapter.B.grad, 0), ctx)
        for factor, grad in (("A", a), ("B", b)):
            out[f"{t.hf_module}.lora_{factor}"] = _relative(
                grad, theirs[f"base_model.model.{t.hf_module}.lora_{factor}.default.weight"].grad)
    return out


def _token_sum(factor: torch.Tensor) -> torch.Tensor:
    """``factor``'s gradient as megatron steps it: summed over the TP ranks where it is marked ``sequence_parallel``
    (applied to each rank's tokens under SP: Doge's ``router_gate`` adapter)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    grad = factor.grad.clone()
    if getattr(factor, "sequence_parallel", False):
        dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
    return grad


def _folder_tensors(folder: str) -> dict[str, tuple]:
    from safetensors.torch import load_file

    return {k: tuple(v.shape) for k, v in load_file(f"{folder}/adapter_model.safetensors").items()}


def _checkpoint_names(folder: str) -> list[str]:
    """The tensor names of every safetensors file in ``folder``."""
    from pathlib import Path

    from safetensors import safe_open

    names = []
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return sorted(names)


def new_bridge_checks(folder: str, out_dir: str, layout: dict, lora_kw: dict) -> dict:
    """The module docstring's checks of one model at ``layout``: differences, PEFT's and our counts, the adapter
    folders' tensor names and shapes."""
    import torch.distributed as dist

    from loongforge_hf.lora.model import PARAM_KINDS

    from ._lora_checks import export_checks, lora_pair
    from ._lora_moe import _check_expert_grads

    ids = torch.randint(4, 203, (2, 24), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    model, ref = lora_pair(folder, layout, lora_kw)[::2]
    ours, theirs = model(**kw), ref(**kw)
    out = {"logits": float((ours.logits - theirs.logits).detach().abs()[mask.bool()].max()),
           "loss": float((ours.loss - theirs.loss).detach().abs()),
           "counts": [tuple(model.get_nb_trainable_parameters()), tuple(ref.get_nb_trainable_parameters())],
           "targets": sorted({t.hf_module.rsplit(".", 1)[-1] for t in model.lora_plan.targets})}
    ours.loss.backward()
    theirs.loss.backward()
    out["grads"] = _dense_grads(model, ref)
    moe_layers = sorted({t.layer for t in model.lora_plan.targets if t.kind in PARAM_KINDS})
    for layer in moe_layers:   # NOTE: raises naming the factor that differs
        _check_expert_grads(model, ref, layer=layer)
    out["moe_layers"] = moe_layers
    model.zero_grad(set_to_none=True)
    out.update(export_checks(model, folder, out_dir, ids, model(input_ids=ids).logits.detach()))
    if dist.get_rank() == 0:
        ref.save_pretrained(out_dir + "/peft")
        out["folder"] = [_folder_tensors(out_dir + "/adapter"), _folder_tensors(out_dir + "/peft")]
        out["merged_names"] = [_checkpoint_names(out_dir + "/merged"), _checkpoint_names(folder)]
    if any(t.own_weight for t in model.lora_plan.targets):
        out["own_weights"] = _own_weight_switches(model, ref, ids)
    return out


def _own_weight_switches(model, ref, ids) -> dict:
    """Adapters on our modules' own weights (lora/own_weights.py) switched off: ``disable_adapter()`` and then
    ``unload()`` give PEFT's base logits (largest differences), and unloading restores the modules' classes."""
    from loongforge_hf.lora.own_weights import LoraOwnWeights

    with torch.no_grad(), ref.disable_adapter():
        base = ref(input_ids=ids).logits
    with torch.no_grad(), model.disable_adapter():
        disabled = float((model(input_ids=ids).logits - base).abs().max())
    adapted = {type(m).__mro__[1] for c in model.chunks for m in c.modules() if isinstance(m, LoraOwnWeights)}
    model.unload()
    with torch.no_grad():
        unloaded = float((model(input_ids=ids).logits - base).abs().max())
    left = [type(m).__name__ for c in model.chunks for m in c.modules() if "lora" in m._modules]
    restored = {type(m) for c in model.chunks for m in c.modules()} >= adapted
    return {"disabled": disabled, "unloaded": unloaded, "restored": restored and not left and bool(adapted)}


def _world(folders: dict, out_dir: str, layouts: dict) -> dict:
    return {arch: new_bridge_checks(folder, f"{out_dir}/{arch}", layouts.get(arch, {}), ADAPTERS[arch])
            for arch, folder in folders.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-new-bridges")
    folders = {arch: str(make_tiny_checkpoint(base / arch, CHECKPOINT_OF.get(arch, (arch, {}))[0], tokenizer=False,
                                              **CHECKPOINT_OF.get(arch, (arch, {}))[1])) for arch in ADAPTERS}
    for arch in DOGE_ARCHS:  # NOTE: A drawn (transformers' zeros leave the dynamic bias, so dt_proj, without effect)
        randomize(folders[arch])
    one = run_distributed(_world, 1, folders, str(base / "tp1"), {}, timeout=600)
    two = run_distributed(_world, 2, folders, str(base / "tp2"), TP2_LAYOUTS, timeout=600)
    return {"tp1": one, "tp2_sp": two}


def _check(ranks: list[dict], tol: float = 1e-4) -> None:
    for res in ranks:
        assert res["logits"] < tol and res["loss"] < 1e-5 and res["unchanged_after_merged_export"], res
        assert res["counts"][0] == res["counts"][1], res["counts"]
        worst = max(res["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < tol, (worst, res["grads"])
        if "own_weights" in res:  # NOTE: disable_adapter / unload with adapters on our modules' own weights
            own = res["own_weights"]
            assert own["disabled"] < tol and own["unloaded"] < tol and own["restored"], own
    first = ranks[0]
    assert first["folder"][0] == first["folder"][1], first["folder"]
    assert first["adapter_logits_diff"] < tol and first["merged_logits_diff"] < tol, first


@pytest.mark.parametrize("arch", list(ADAPTERS))
def test_tp1_matches_peft(results, arch):
    _check([r[arch] for r in results["tp1"]])


@pytest.mark.parametrize("arch", list(TP2_LAYOUTS))
def test_tp2_sp_matches_peft(results, arch):
    _check([r[arch] for r in results["tp2_sp"]])


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp"])
@pytest.mark.parametrize("arch, fused", [("lara_mini", ".linear_attn.in_proj.weight"),
                                         ("lfm3", ".self_attn.gate_proj.weight")])
def test_merged_export_keeps_checkpoint_names(results, arch, fused, layout):
    """The merged export of adapters on transformers' split / renamed linears (LaraMini's in_proj_qkv / z / b / a,
    LFM3's g_proj) holds the checkpoint's tensors under their names on disk: one fused in_proj, gate_proj."""
    merged, original = results[layout][0][arch]["merged_names"]
    assert merged == original and any(n.endswith(fused) for n in merged), sorted(set(merged) ^ set(original))
