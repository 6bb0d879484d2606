"""LoRA on the token embedding (PEFT's ``lora.Embedding``, ``target_modules=["embed_tokens", ...]``:
``lora/embedding.py``) against PEFT on transformers' model, in one world of two ranks: Llama (untied) at TP1 (DP2)
and TP2 + SP, Gemma (tied, the embedding scaled by ``sqrt(hidden)``) at TP2 + SP.

Choices:
- ``init_lora_weights=False`` (PEFT's ``randn`` A and B kept: the adapter moves the logits) with ``q_proj`` beside;
  a batch whose first row holds the pad token (id 0): its column of A takes no gradient (the lookup's
  ``padding_idx``), B's gradient from it stays, as PEFT's.
- Checks (1e-4; differences stated): logits, loss, A's and B's gradients at HF shape (A's vocabulary gathered over
  TP and trimmed), PEFT's trainable counts, the adapter folder's tensor names and shapes equal to PEFT's (its
  ``lora_embedding_A`` / ``lora_embedding_B`` and the embedding's ``base_layer.weight``, which PEFT writes when the
  embedding is targeted), that folder in ``PeftModel.from_pretrained``, PEFT's folder through our ``load_adapter``;
  the merged export in transformers: Llama's with our logits, Gemma's (tied: merging changes the LM head too, in
  PEFT as here) with PEFT's ``merge_and_unload``; ``disable_adapter()`` and ``unload()`` giving the base logits.
- The planner's refusals (pure): DoRA, PiSSA and ``trainable_token_indices`` with the adapted embedding (with
  ``modules_to_save`` naming it, PEFT trains it whole instead of adapting it, and so does the planner).
"""

from __future__ import annotations

import peft
import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
KW = dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)
TP2_SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
CASES = {"llama_tp1": ("llama", {}), "llama_tp2_sp": ("llama", TP2_SP), "gemma_tp2_sp": ("gemma", TP2_SP)}


def _checks(folder: str, out_dir: str, layout: dict) -> dict:
    from ._lora_checks import _gather_full, adapter_round_trips, lora_pair

    ids = torch.randint(4, 203, (2, 24), generator=torch.Generator().manual_seed(7))
    ids[0, 3] = 0  # NOTE: the pad token as an input
    model, hf, ref = lora_pair(folder, layout, KW)
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out = {"logits": float((ours.logits - theirs.logits).abs().max()), "loss": float((ours.loss - theirs.loss).abs()),
           "counts": [tuple(model.get_nb_trainable_parameters()), tuple(ref.get_nb_trainable_parameters())]}
    ours.loss.backward()
    theirs.loss.backward()
    adapter, params = model.chunks[0].embedding.word_embeddings.lora["embed_tokens"], dict(ref.named_parameters())
    vocab = hf.config.vocab_size
    for factor, got in (("A", _gather_full(adapter.A.grad, 1)[:, :vocab]), ("B", adapter.B.grad)):
        want = params[f"base_model.model.model.embed_tokens.lora_embedding_{factor}.default"].grad
        out[f"grad_{factor}"] = float((got - want).abs().max()) / float(want.abs().max())
    out["pad_column_grad"] = float(params["base_model.model.model.embed_tokens.lora_embedding_A.default"].grad[:, 0]
                                   .abs().max())
    model.zero_grad(set_to_none=True)
    return {**out, **adapter_round_trips(model, ref, folder, out_dir, layout, ids, theirs.logits)}


def _world(folders: dict, root: str) -> dict:
    return {case: _checks(folders[arch], f"{root}/{case}", layout) for case, (arch, layout) in CASES.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-embedding")
    folders = {arch: str(make_tiny_checkpoint(root / arch, arch, tokenizer=False)) for arch in ("llama", "gemma")}
    return run_distributed(_world, 2, folders, str(root / "runs"), timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_embedding_lora_matches_peft(results, case):
    for rank in results:
        r = rank[case]
        assert max(r["logits"], r["grad_A"], r["grad_B"], r["disabled"], r["unloaded"],
                   r["load_adapter_logits"]) < TOL and r["loss"] < 1e-5, r
        assert r["counts"][0] == r["counts"][1] and r["unchanged_after_merged_export"], r
    first = results[0][case]
    assert first["pad_column_grad"] == 0.0, first  # NOTE: the case exercises the padding_idx column
    assert first["folder"][0] == first["folder"][1] and first["adapter_logits"] < TOL, first
    assert "base_model.model.model.embed_tokens.base_layer.weight" in first["folder"][0], first["folder"][0]
    # NOTE: a tied LM head takes the merged embedding in PEFT's merge too: the merged model is PEFT's merged one
    assert first["merged_vs_peft_merged"] < TOL, first
    if not case.startswith("gemma"):
        assert first["merged_vs_ours"] < TOL, first


@pytest.mark.parametrize("extra, named", [
    (dict(use_dora=True), "use_dora=True with LoRA on the token embedding"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa' with LoRA on the token embedding"),
    (dict(trainable_token_indices=[5]), "trainable_token_indices with LoRA on the token embedding")])
def test_embedding_lora_refusals(extra, named):
    from loongforge_hf.bridges.registry import get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("llama", architectures=["LlamaForCausalLM"]))
    plan = plan_lora(bridge, peft.LoraConfig(r=4, target_modules=["embed_tokens"]))
    assert [(t.kind, t.a_shape, t.b_shape, t.layer) for t in plan.targets] == [("embedding", (4, 203), (64, 4), None)]
    with pytest.raises(LoraConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        plan_lora(bridge, peft.LoraConfig(**{**dict(r=4, target_modules=["embed_tokens", "q_proj"]), **extra}))
