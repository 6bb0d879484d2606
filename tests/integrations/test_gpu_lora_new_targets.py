"""This release's new LoRA targets on the CUDA path (marked ``gpu``): the token embedding (``lora/embedding.py``), our
modules' own weights (``lora/own_weights.py``: Mamba-1's ``x_proj``, Doge's ``dt_proj`` / ``router_gate``, Kimi
Linear's gates, JetMoE's attention router) and Gemma 3n's replicated AltUp / LAuReL / per-layer linears
(``lora/replicated.py``), and the untied LM head (``lora/head.py``, on Llama), each against PEFT on transformers'
model on the same GPU, one process, fp32: logits (1e-3: summation order only), loss from the logits and from the loss
fused with the head (1e-4) and every module adapter's gradient through the fused loss (1e-3 relative to its
largest). The CPU tests
(tests/integrations/test_lora_new_bridges.py, test_lora_embedding.py, tests/bridges/test_jetmoe.py) cover the
parallel layouts."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ALL_LINEAR = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
CASES = {
    "llama": dict(ALL_LINEAR, target_modules=["embed_tokens", "q_proj", "v_proj", "down_proj", "lm_head"]),
    "mamba": dict(ALL_LINEAR, exclude_modules=["out_proj", "dt_proj"]),
    "doge_moe": ALL_LINEAR, "kimi_linear": ALL_LINEAR, "jetmoe": ALL_LINEAR,
    "gemma3n": dict(ALL_LINEAR, exclude_modules=r".*(correction_coefs|altup_projections|altup_unembed_projections|"
                                                r"per_layer_model_projection).*"),
}


def _against_peft(folder: str, lora_kw: dict) -> dict:
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(5)
    model = get_peft_model(model, peft.LoraConfig(**lora_kw))
    hf = hf_causal_lm(folder, dtype=torch.float32).to(model.device)
    transformers.set_seed(5)
    ref = peft.get_peft_model(hf, peft.LoraConfig(**lora_kw))
    ids = torch.randint(4, 203, (2, 24), generator=torch.Generator().manual_seed(7)).to(model.device)
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    # NOTE: the gradients of the training path: the loss fused with the LM head (Triton's on one CUDA rank)
    fused = model(input_ids=ids, labels=ids, return_logits=False).loss
    fused.backward()
    theirs.loss.backward()
    from ._lora_checks import lora_shard_context

    params, grads, ctx = dict(ref.named_parameters()), {}, lora_shard_context(model)
    for t in model.lora_plan.targets:
        if t.kind in ("experts", "router"):
            continue
        path = "embedding.word_embeddings" if t.kind == "embedding" else t.megatron_module.format(layer=t.layer)
        adapter = model.chunks[0].get_submodule(path).lora[t.name]
        for factor, name in zip("AB", t.file_factors):
            want = params[f"base_model.model.{t.hf_module}.{name.removesuffix('.weight')}.default" +
                          (".weight" if name.endswith(".weight") else "")].grad
            got = getattr(adapter, factor).grad
            got = got[:, :want.shape[1]] if t.kind == "embedding" and factor == "A" else \
                got[:want.shape[0]] if t.kind == "head" and factor == "B" else t.b_to_hf(got, ctx) \
                if factor == "B" and t.kind not in ("row", "replicated", "embedding") else got
            grads[f"{t.hf_module}.{factor}"] = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
    return {"device": str(model.device), "logits": float((ours.logits - theirs.logits).abs().max()),
            "loss": float((ours.loss - theirs.loss).abs()), "fused_loss": float((fused - theirs.loss).abs()),
            "grads": grads,
            "targets": sorted({t.name for t in model.lora_plan.targets})}


@pytest.mark.parametrize("arch", CASES)
def test_new_lora_targets_on_cuda_match_peft(tmp_path, arch):
    from loongforge_hf.testing.tiny_doge import randomize
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / arch, arch, tokenizer=False)
    if arch.startswith("doge"):
        randomize(folder)  # NOTE: A drawn, so dt_proj (and its adapter) acts
    [r] = run_distributed(_against_peft, 1, str(folder), CASES[arch], timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["device"].startswith("cuda") and r["logits"] < 1e-3 and max(r["loss"], r["fused_loss"]) < 1e-4, r
    worst = max(r["grads"].items(), key=lambda kv: kv[1])
    assert r["grads"] and worst[1] < 1e-3, (worst, r["targets"])
