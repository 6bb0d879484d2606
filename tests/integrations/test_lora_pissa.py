"""PiSSA and OLoRA (``LoraConfig(init_lora_weights="pissa" | "pissa_niter_<n>" | "olora")``) against PEFT.

One single-rank run (tiny Llama, all-linear, one ``rank_pattern`` entry; Phi-3's packed ``qkv_proj`` /
``gate_up_proj``; GPT-2's Conv1D linears, stored ``[in, out]``; DoRA on PiSSA) and one two-rank run (TP2 + SP
with ``pissa_niter_2``, PP2 with OLoRA, Phi-3 at TP2 with PiSSA), each against ``peft.get_peft_model`` on the
transformers model after the same seed:
- every A and B and every residual base weight (the bridge's HF export of the base, ``W - scaling * B @ A``) equal to
  PEFT's bit for bit at TP1 (LAPACK in the same process: same singular vectors, signs included), and the CPU
  generator left where PEFT leaves it (``pissa_niter``'s draws replayed on the rank that decomposes each target);
- logits (1e-5), loss, every adapter gradient at HF shape, and the loss after one SGD step on both (not under PP);
- the adapter folder: PEFT's tensors and config; it loads in PEFT onto the original model (PEFT decomposes again) and,
  with ``init_lora_weights=True``, onto the saved residual model, and here through ``load_adapter``, all with the
  trained logits; the merged export at init is the original checkpoint (<= 1e-6); after the step the merged export
  and PEFT's ``path_initial_model_for_weight_conversion`` (a plain LoRA adapter of rank 2r on the original model)
  give the trained logits;
- refusals: other initialisations, experts / router targets, r above a target's min(in, out), the conversion with
  DoRA or rsLoRA + patterns or ``merged=True``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_checks import _gather_full, lora_shard_context

SEED = 5
LLAMA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"o_proj": 2})
PHI3_KW = dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
               init_lora_weights="pissa")
# NOTE: GPT-2's Conv1D weights are stored [in, out]: PEFT decomposes them transposed (fan_in_fan_out)
GPT2_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights="pissa")


def _ids() -> torch.Tensor:
    return torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))


def _pair(folder: str, layout: dict, kw: dict):
    """(ours, PEFT's, whether the CPU generator ends in the same state after both get_peft_model)."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    transformers.set_seed(SEED)
    model = get_peft_model(model, peft.LoraConfig(**kw))
    ours = torch.get_rng_state()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(SEED)
    ref = peft.get_peft_model(hf, peft.LoraConfig(**kw))
    return model, ref, torch.equal(ours, torch.get_rng_state())


def _adapter(model, t):
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.builder import layer_owners

    owner_pp, vp, local = layer_owners(model.megatron.config, model.parallel)[t.layer]
    if owner_pp != ps.get_pipeline_model_parallel_rank():
        return None
    return model.chunks[vp or 0].get_submodule(t.megatron_module.format(layer=local)).lora[t.name]


def _full(model, t, tensors) -> dict:
    """{"A": ..., "B": ...} of ``tensors`` (this rank's A and B of target ``t``, or their gradients) at HF shape."""
    column = t.kind != "row"
    a, b = tensors
    return {"A": _gather_full(a, None if column else 1),
            "B": t.b_to_hf(_gather_full(b, 0 if column else None), lora_shard_context(model))}


def _factor_diffs(model, ref, grads: bool) -> tuple[float, bool, int]:
    """(max |ours - PEFT's|, all equal bit for bit, how many compared) over every A and B (or their gradients) of the
    targets on this rank's stage."""
    theirs = dict(ref.named_parameters())
    worst, equal, compared = 0.0, True, 0
    for t in model.lora_plan.targets:
        adapter = _adapter(model, t)
        if adapter is None:
            continue
        pair = (adapter.A.grad, adapter.B.grad) if grads else (adapter.A.detach(), adapter.B.detach())
        for factor, ours in _full(model, t, pair).items():
            param = theirs[f"base_model.model.{t.hf_module}.lora_{factor}.default.weight"]
            expected = param.grad if grads else param.detach()
            worst = max(worst, float((ours - expected).abs().max()))
            equal &= torch.equal(ours, expected)
            compared += 1
    return worst, equal, compared


def _sgd_step(params, lr: float = 0.5) -> None:
    with torch.no_grad():
        for p in params:
            if p.requires_grad and p.grad is not None:
                p.sub_(lr * p.grad)
                p.grad = None


def _peft_logits(base_folder: str, adapter_dir: str, ids, *, init_true: bool = False) -> torch.Tensor:
    import peft
    import transformers

    config = peft.LoraConfig.from_pretrained(adapter_dir)
    if init_true:  # NOTE: PEFT's PiSSA example: an adapter for a saved residual model says init_lora_weights=True
        config.init_lora_weights = True
    transformers.set_seed(SEED)  # NOTE: pissa_niter: PEFT draws svd_lowrank's test matrix again when it loads
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32), adapter_dir, config=config)
    with torch.no_grad():
        return model(input_ids=ids).logits


def parity_checks(folder: str, out: str, layout: dict, kw: dict, *, exports: bool) -> dict:
    """Ours against PEFT for one LoraConfig in one layout (every rank's results; exports checked on rank 0)."""
    import transformers
    from safetensors.torch import load_file

    import loongforge_hf as lf
    from loongforge_hf.bridges.checkpoint_io import CheckpointReader
    from loongforge_hf.lora import load_adapter
    from loongforge_hf.modeling import LoongModelForCausalLM

    ids = _ids()
    model, ref, same_rng = _pair(folder, layout, kw)
    rank0 = dist.get_rank() == 0
    res = {"same_rng": same_rng}
    res["factor_diff"], res["factors_equal"], res["factors"] = _factor_diffs(model, ref, grads=False)

    # the residual base weights, as the HF export of the model under the adapters writes them
    LoongModelForCausalLM.save_pretrained(model, out + "/residual")
    model.save_pretrained(out + "/initial")
    model.save_pretrained(out + "/merged-init", merged=True)
    if rank0:
        residual, original = CheckpointReader(out + "/residual"), CheckpointReader(folder)
        merged, theirs = CheckpointReader(out + "/merged-init"), ref.get_base_model().state_dict()

        def peft_residual(name):  # NOTE: an adapted linear's weight (and bias) is its base_layer's in PEFT's tree
            module, _, param = name.rpartition(".")
            return theirs.get(f"{module}.base_layer.{param}", theirs.get(name))

        names = original.keys()
        res["residual_diff"] = max(float((residual.get(n) - peft_residual(n)).abs().max()) for n in names)
        res["residual_moved"] = max(float((residual.get(n) - original.get(n)).abs().max()) for n in names)
        res["merged_init_diff"] = max(float((merged.get(n) - original.get(n)).abs().max()) for n in names)
        ref.save_pretrained(out + "/peft-initial")
        mine, peft_s = load_file(out + "/initial/adapter_model.safetensors"), load_file(
            out + "/peft-initial/adapter_model.safetensors")
        res["saved_names_equal"] = sorted(mine) == sorted(peft_s)
        res["saved_diff"] = max(float((mine[n] - peft_s[n]).abs().max()) for n in peft_s)
        saved_config = json.loads(open(out + "/initial/adapter_config.json").read())
        res["saved_init_as_given"] = saved_config["init_lora_weights"] == kw["init_lora_weights"]

    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    res["logits_diff"] = float((ours.logits - theirs.logits).abs().max())
    res["loss_diff"] = abs(float(ours.loss) - float(theirs.loss))
    pipeline = model.parallel.pipeline_parallel_size > 1
    if not pipeline:
        ours.loss.backward()
        theirs.loss.backward()
        res["grad_diff"], _, res["grads"] = _factor_diffs(model, ref, grads=True)
        first = float(ours.loss)
        _sgd_step(model.parameters())
        _sgd_step(ref.parameters())
        ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        res["stepped_loss_diff"] = abs(float(ours.loss) - float(theirs.loss))
        res["step_moved_loss"] = abs(float(ours.loss) - first)
    if not exports:
        return res

    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(out + "/trained")
    model.save_pretrained(out + "/merged", merged=True)
    model.save_pretrained(out + "/converted", path_initial_model_for_weight_conversion=out + "/initial")
    if rank0:
        res["peft_on_original_diff"] = float((_peft_logits(folder, out + "/trained", ids) - logits).abs().max())
        res["peft_on_residual_diff"] = float((_peft_logits(out + "/residual", out + "/trained", ids, init_true=True)
                                              - logits).abs().max())
        res["converted_diff"] = float((_peft_logits(folder, out + "/converted", ids) - logits).abs().max())
        res["converted_r"] = json.loads(open(out + "/converted/adapter_config.json").read())["r"]
        with torch.no_grad():
            merged = transformers.AutoModelForCausalLM.from_pretrained(out + "/merged", dtype=torch.float32)
            res["merged_diff"] = float((merged(input_ids=ids).logits - logits).abs().max())
    transformers.set_seed(SEED)
    loaded = load_adapter(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
                          out + "/trained")
    with torch.no_grad():
        res["load_adapter_diff"] = float((loaded(input_ids=ids).logits - logits).abs().max())
    for bad, kwargs in (("merged", dict(merged=True)), ("dora", {})):
        try:
            if bad == "dora":
                model.lora_config.use_dora = True
            model.save_pretrained(out + "/bad", path_initial_model_for_weight_conversion=out + "/initial", **kwargs)
            res[f"refused_{bad}"] = None
        except ValueError as err:
            res[f"refused_{bad}"] = str(err)
        finally:
            model.lora_config.use_dora = False
    return res


def one_rank_checks(llama: str, phi3: str, gpt2: str, out: str) -> dict:
    return {"pissa": parity_checks(llama, out + "/pissa", {}, dict(LLAMA_KW, init_lora_weights="pissa"),
                                   exports=True),
            "olora": parity_checks(llama, out + "/olora", {}, dict(LLAMA_KW, init_lora_weights="olora"),
                                   exports=True),
            "pissa_niter": parity_checks(llama, out + "/niter", {}, dict(LLAMA_KW, init_lora_weights="pissa_niter_2"),
                                         exports=False),
            "dora": parity_checks(llama, out + "/dora", {}, dict(LLAMA_KW, init_lora_weights="pissa", use_dora=True),
                                  exports=False),
            "phi3": parity_checks(phi3, out + "/phi3", {}, PHI3_KW, exports=False),
            "gpt2": parity_checks(gpt2, out + "/gpt2", {}, GPT2_KW, exports=False)}


def two_rank_checks(llama: str, phi3: str, out: str) -> dict:
    return {"tp2_sp_niter": parity_checks(llama, out + "/tp2", {"tensor_parallel_size": 2, "sequence_parallel": True},
                                          dict(LLAMA_KW, init_lora_weights="pissa_niter_2"), exports=True),
            "pp2_olora": parity_checks(llama, out + "/pp2", {"pipeline_parallel_size": 2},
                                       dict(LLAMA_KW, init_lora_weights="olora"), exports=True),
            "phi3_tp2": parity_checks(phi3, out + "/phi3", {"tensor_parallel_size": 2}, PHI3_KW, exports=False)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("pissa-src")
    return {arch: str(make_tiny_checkpoint(base / arch, arch)) for arch in ("llama", "phi3", "gpt2")}


@pytest.fixture(scope="module")
def one_rank(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("pissa-tp1")
    [result] = run_distributed(one_rank_checks, 1, checkpoints["llama"], checkpoints["phi3"], checkpoints["gpt2"],
                               str(out), timeout=400)
    return result


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("pissa-2")
    return run_distributed(two_rank_checks, 2, checkpoints["llama"], checkpoints["phi3"], str(out), timeout=400)


def _assert_parity(res: dict, *, pipeline: bool = False) -> None:
    """Factors within 1e-6 (measured: PiSSA / OLoRA equal bit for bit, ``pissa_niter`` 2.3e-7 on some targets: BLAS
    results there depend on the input's memory alignment; a singular vector of the other sign would be ~1e-1 off),
    logits / loss / gradients / the loss after one step within 1e-5 (measured <= 4.8e-7)."""
    assert res["same_rng"], res
    assert res["factors"] > 0 and res["factor_diff"] < 1e-6, res
    assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
    if not pipeline:
        assert res["grads"] == res["factors"] and res["grad_diff"] < 1e-5, res
        assert res["stepped_loss_diff"] < 1e-5 and res["step_moved_loss"] > 1e-3, res


@pytest.mark.parametrize("case", ["pissa", "olora", "pissa_niter", "dora", "phi3", "gpt2"])
def test_one_rank_matches_peft(one_rank, case):
    res = one_rank[case]
    _assert_parity(res)
    assert res["residual_diff"] < 1e-6 and res["residual_moved"] > 1e-2, res
    assert res["merged_init_diff"] < 1e-6, res
    assert res["saved_names_equal"] and res["saved_diff"] < 1e-6 and res["saved_init_as_given"], res


@pytest.mark.parametrize("case", ["pissa", "olora"])
def test_one_rank_exports(one_rank, case):
    res = one_rank[case]
    for key in ("peft_on_original_diff", "peft_on_residual_diff", "converted_diff", "merged_diff",
                "load_adapter_diff"):
        assert res[key] < 1e-5, (key, res)
    assert res["converted_r"] == 2 * LLAMA_KW["r"]
    assert "merged" in res["refused_merged"] and "DoRA" in res["refused_dora"], res


@pytest.mark.parametrize("layout", ["tp2_sp_niter", "pp2_olora", "phi3_tp2"])
def test_two_ranks_match_peft(two_ranks, layout):
    for r in two_ranks:
        res = r[layout]
        _assert_parity(res, pipeline=layout.startswith("pp2"))
    rank0 = two_ranks[0][layout]
    assert rank0["residual_diff"] < 1e-6 and rank0["merged_init_diff"] < 1e-6 and rank0["saved_diff"] < 1e-6, rank0
    if layout != "phi3_tp2":
        for key in ("peft_on_original_diff", "peft_on_residual_diff", "converted_diff", "merged_diff"):
            assert rank0[key] < 1e-5, (key, rank0)
        for r in two_ranks:
            assert r[layout]["load_adapter_diff"] < 1e-5, r[layout]


@pytest.mark.parametrize("kw, match", [
    (dict(target_modules=["q_proj"], init_lora_weights="loftq", loftq_config={"loftq_bits": 4}),
     "not supported; use True"),
    (dict(target_modules=["q_proj"], init_lora_weights="mica"), "not supported; use True"),
    (dict(target_modules=["q_proj"], init_lora_weights="eva"), "not supported; use True"),
    (dict(target_modules=["q_proj"], init_lora_weights="corda"), "not supported; use True"),
    (dict(target_modules=["q_proj"], init_lora_weights="pissa_niter_x"), "pissa_niter_<n>"),
    (dict(target_modules=["k_proj"], r=40, init_lora_weights="pissa"), r"r=40 exceeds min\(in, out\) = 32"),
])
def test_refused_configs(checkpoints, kw, match):
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(checkpoints["llama"]))
    with pytest.raises(LoraConfigError, match=match):
        plan_lora(bridge, peft.LoraConfig(**kw))


def test_conversion_refused_with_rslora_and_patterns():
    """As PEFT's save_pretrained(path_initial_model_for_weight_conversion=...) (the config itself is accepted, PEFT
    only warns); DoRA and merged=True: test_one_rank_exports."""
    from types import SimpleNamespace

    import peft

    from loongforge_hf.lora.export import check_convertible

    config = peft.LoraConfig(r=4, target_modules=["q_proj"], use_rslora=True, rank_pattern={"q_proj": 2},
                             init_lora_weights="olora")
    model = SimpleNamespace(lora_config=config, lora_plan=SimpleNamespace(targets=[]))
    with pytest.raises(ValueError, match="use_rslora=True"):
        check_convertible(model, merged=False)
    config.rank_pattern = {}
    check_convertible(model, merged=False)


def test_refused_on_experts_and_router(tmp_path):
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    folder = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folder))
    for init in ("pissa", "olora"):
        with pytest.raises(LoraConfigError, match="expert stacks / the router"):
            plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear", init_lora_weights=init))
    # the attention alone decomposes
    assert plan_lora(bridge, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights="pissa")).targets


def test_refused_on_a_vision_tower():
    import peft

    from loongforge_hf.bridges.qwen2_5_vl import get_vl_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora
    from loongforge_hf.testing.tiny_vl import tiny_vl_config

    config = tiny_vl_config()
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    bridge = get_vl_bridge(config)
    with pytest.raises(LoraConfigError, match="vision tower"):
        plan_lora(bridge.text, peft.LoraConfig(r=2, target_modules="all-linear", init_lora_weights="pissa"),
                  vl_bridge=bridge)
    language = peft.LoraConfig(r=2, target_modules=r".*language_model.*q_proj", init_lora_weights="pissa")
    assert len(plan_lora(bridge.text, language, vl_bridge=bridge).targets) == config.text_config.num_hidden_layers
