"""LoRA on the untied LM head (PEFT's ``lora.Linear`` on ``lm_head``: ``lora/head.py``) against PEFT on transformers'
model, in one world of two ranks: Llama (untied) at TP1 (DP2), TP2 + SP, PP2 and CP2; Phi (a biased LM head) at
TP2.

Choices:
- ``init_lora_weights=False`` (PEFT's Kaiming A and random B kept: the adapter moves the logits), ``q_proj`` beside
  (PP2's first stage has something to train); fp32.
- Checks (1e-4; differences stated): the logits (megatron's output layer with LoRA's column-parallel forward), the
  loss (1e-5) both from the logits and from the fused loss (``return_logits=False``: the loss adds ``z @ B^T`` to
  each chunk's logits, ``kernels.cross_entropy``'s ``low_rank``), and A's / B's gradients through either (not under
  PP: training at PP2 is ``test_head_lora_trains_alike_under_pp``), B's gathered over TP and trimmed to the
  vocabulary; PEFT's trainable counts; the adapter folder's tensor names and shapes equal to PEFT's
  (``lm_head.lora_A`` / ``lora_B`` and the head's ``base_layer.weight``, which PEFT writes for a targeted
  ``lm_head``), that folder in ``PeftModel.from_pretrained``, PEFT's folder through our ``load_adapter``; the merged
  export in transformers with our logits; ``disable_adapter()`` and ``unload()`` giving the base logits.
- The planner's refusals (pure): a tied LM head (by name, with why), DoRA and PiSSA on the head.
- Dropout on the fused path at TP2 + SP (``test_head_dropout_fused_loss``): the mask acts, and is the same on both
  TP ranks (A's gradient equal on both).
"""

from __future__ import annotations

import peft
import pytest
import torch
import torch.distributed as dist

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
KW = dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
CASES = {"llama_tp1": ("llama", {}), "llama_tp2_sp": ("llama", {"tensor_parallel_size": 2, "sequence_parallel": True}),
         "llama_pp2": ("llama", {"pipeline_parallel_size": 2}), "llama_cp2": ("llama", {"context_parallel_size": 2}),
         "phi_tp2": ("phi", {"tensor_parallel_size": 2})}


def _head_grads(model, ref, vocab: int) -> dict:
    """{A, B: max |ours - PEFT's| / max |PEFT's|} of the LM head adapter's gradients (B gathered over TP); empty on a
    stage without the head."""
    from ._lora_checks import _gather_full

    layer = model.chunks[-1].output_layer if model.chunks[-1].post_process else None
    if layer is None:
        return {}
    from megatron.core import parallel_state as ps

    adapter, params, out = layer.lora["lm_head"], dict(ref.named_parameters()), {}
    grads = [adapter.A.grad.clone(), adapter.B.grad.clone()]
    if ps.get_context_parallel_world_size() > 1:  # NOTE: each CP rank holds its sequence share's part, as DDP sums
        for g in grads:
            dist.all_reduce(g, group=ps.get_context_parallel_group())
    for factor, got in (("A", grads[0]), ("B", _gather_full(grads[1], 0)[:vocab])):
        want = params[f"base_model.model.lm_head.lora_{factor}.default.weight"].grad
        out[factor] = float((got - want).abs().max()) / float(want.abs().max())
    return out


def _checks(folder: str, out_dir: str, layout: dict) -> dict:
    from ._lora_checks import adapter_round_trips, lora_pair

    ids = torch.randint(4, 203, (2, 24), generator=torch.Generator().manual_seed(7))
    model, hf, ref = lora_pair(folder, layout, KW)
    vocab = hf.config.vocab_size
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out = {"logits": float((ours.logits - theirs.logits).abs().max()), "loss": float((ours.loss - theirs.loss).abs()),
           "counts": [tuple(model.get_nb_trainable_parameters()), tuple(ref.get_nb_trainable_parameters())]}
    fused = model(input_ids=ids, labels=ids, return_logits=False)
    out["fused_loss"] = float((fused.loss - theirs.loss).abs())
    theirs.loss.backward()
    if not layout.get("pipeline_parallel_size"):  # NOTE: a pipeline's forward gives no graph to go back through
        ours.loss.backward()
        out["grads_logits_path"] = _head_grads(model, ref, vocab)
        model.zero_grad(set_to_none=True)
        fused.loss.backward()
        out["grads_fused"] = _head_grads(model, ref, vocab)
        model.zero_grad(set_to_none=True)
    return {**out, **adapter_round_trips(model, ref, folder, out_dir, layout, ids, theirs.logits)}


def _world(folders: dict, root: str) -> dict:
    return {case: _checks(folders[arch], f"{root}/{case}", layout) for case, (arch, layout) in CASES.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-head")
    folders = {arch: str(make_tiny_checkpoint(root / arch, arch, tokenizer=False)) for arch in ("llama", "phi")}
    return run_distributed(_world, 2, folders, str(root / "runs"), timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_head_lora_matches_peft(results, case):
    for rank in results:
        r = rank[case]
        assert max(r["logits"], r["disabled"], r["unloaded"], r["load_adapter_logits"]) < TOL, r
        assert r["loss"] < 1e-5 and r["fused_loss"] < 1e-5, r
        assert r["counts"][0] == r["counts"][1] and r["unchanged_after_merged_export"], r
        if not case.endswith("pp2"):
            for grads in (r["grads_logits_path"], r["grads_fused"]):
                assert sorted(grads) == ["A", "B"] and max(grads.values()) < TOL, r
    first = results[0][case]
    assert first["folder"][0] == first["folder"][1] and first["adapter_logits"] < TOL, first
    assert "base_model.model.lm_head.base_layer.weight" in first["folder"][0], first["folder"][0]
    assert first["merged_vs_ours"] < TOL and first["merged_vs_peft_merged"] < TOL, first


def _head_dropout(folder: str) -> dict:
    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                    sequence_parallel=True)
    model = get_peft_model(model, peft.LoraConfig(**{**KW, "target_modules": ["lm_head"], "lora_dropout": 0.5}))
    ids = torch.randint(4, 203, (2, 24), generator=torch.Generator().manual_seed(7))
    adapter, out = model.chunks[-1].output_layer.lora["lm_head"], {}
    for seed in (11, 12):
        torch.manual_seed(seed)
        model.train()
        loss = model(input_ids=ids, labels=ids, return_logits=False).loss
        loss.backward()
        grads = [torch.empty_like(adapter.A.grad) for _ in range(2)]
        dist.all_gather(grads, adapter.A.grad)
        out[seed] = (float(loss), float((grads[0] - grads[1]).abs().max()), float(grads[0].abs().max()))
        model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        out["eval"] = float(model(input_ids=ids, labels=ids, return_logits=False).loss)
    return out


def test_head_dropout_fused_loss(tmp_path):
    """With lora_dropout the fused loss drops out the adapter's input (each seed its own mask, none in eval mode), the
    same mask on both TP ranks (A, replicated, gets the same gradient on each)."""
    folder = str(make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False))
    for r in run_distributed(_head_dropout, 2, folder, timeout=300):
        (loss_a, diff_a, size_a), (loss_b, diff_b, size_b) = r[11], r[12]
        assert diff_a == 0.0 and diff_b == 0.0 and size_a > 0 and size_b > 0, r
        assert abs(loss_a - loss_b) > 1e-4 and abs(loss_a - r["eval"]) > 1e-4, r


HEAD_KW = dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
TRAINED_LAYOUTS = {"pp2": {"pipeline_parallel_size": 2},
                   "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}}


def _train(folder: str, out_dir: str, layouts: dict | None) -> dict:
    """Step losses and the final eval loss of transformers.Trainer + PEFT (``layouts`` None) or of LoongTrainer with
    our adapters in each of ``layouts``, and (ours, rank 0) the saved adapter's logits in PEFT against the model's."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    from ..trainer._train_parity import losses_of, make_dataset, training_args

    def run(model, trainer_class, name):
        trainer = trainer_class(model=model, args=training_args(f"{out_dir}/{name}", learning_rate=2e-2),
                                train_dataset=make_dataset(), eval_dataset=make_dataset(n=8, seed=11))
        trainer.train()
        return trainer, losses_of(trainer.state.log_history) + [trainer.evaluate()["eval_loss"]]

    if layouts is None:
        transformers.set_seed(5)
        return {"hf": run(peft.get_peft_model(hf_causal_lm(folder, dtype=torch.float32), peft.LoraConfig(**HEAD_KW)),
                          transformers.Trainer, "hf")[1]}
    out = {}
    for name, layout in layouts.items():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        transformers.set_seed(5)
        trainer, losses = run(get_peft_model(model, peft.LoraConfig(**HEAD_KW)), lf.LoongTrainer, name)
        trainer.model.save_pretrained(f"{out_dir}/{name}/adapter")
        ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(11))
        with torch.no_grad():
            trained = trainer.model(input_ids=ids).logits
        out[name] = {"losses": losses}
        if dist.get_rank() == 0:
            with torch.no_grad():
                loaded = peft.PeftModel.from_pretrained(hf_causal_lm(folder, dtype=torch.float32),
                                                        f"{out_dir}/{name}/adapter")
                out[name]["adapter_logits"] = float((loaded(input_ids=ids).logits - trained).abs().max())
    return out


def test_head_lora_trains_alike_under_pp(tmp_path):
    """LoongTrainer with LoRA on the LM head (the fused loss's low-rank term, megatron's schedules) at PP2 and at
    TP2 + SP against transformers.Trainer + PEFT (trl.SFTTrainer 1.16 refuses an adapter on ``lm_head``: its fused
    loss reads the head's weight): the four step losses and the final eval loss (1e-4 relative), and the saved
    adapter in PEFT giving the trained model's logits (1e-4)."""
    folder = str(make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=False))
    ref = run_distributed(_train, 1, folder, str(tmp_path / "hf"), None, timeout=400)[0]["hf"]
    ours = run_distributed(_train, 2, folder, str(tmp_path / "lf"), TRAINED_LAYOUTS, timeout=500)
    assert len(ref) == 5 and ref[0] != ref[3], ref
    for layout in TRAINED_LAYOUTS:
        assert ours[0][layout]["losses"] == pytest.approx(ref, rel=1e-4), (layout, ours[0][layout], ref)
        assert ours[0][layout]["adapter_logits"] < TOL, (layout, ours[0][layout])


@pytest.mark.parametrize("arch, extra, named", [
    ("gemma", {}, "tied to the input embedding"),
    ("llama", dict(use_dora=True), "use_dora=True with LoRA on the LM head"),
    ("llama", dict(init_lora_weights="pissa"), "init_lora_weights='pissa' with LoRA on the LM head")])
def test_head_lora_refusals(arch, extra, named):
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config(arch, architectures=[f"{arch.capitalize()}ForCausalLM"]))
    if not extra:
        with pytest.raises(LoraConfigError, match=named):
            plan_lora(bridge, peft.LoraConfig(r=4, target_modules=["lm_head"]))
        return
    plan = plan_lora(bridge, peft.LoraConfig(r=4, target_modules=["lm_head"]))
    assert [(t.kind, t.a_shape, t.b_shape, t.layer) for t in plan.targets] == [("head", (4, 64), (203, 4), None)]
    with pytest.raises(LoraConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        plan_lora(bridge, peft.LoraConfig(**{**dict(r=4, target_modules=["lm_head", "q_proj"]), **extra}))
