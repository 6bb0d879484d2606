"""LoRA and DoRA on Gemma 3 and OLMo 2, whose layers normalise the attention and MLP outputs (post norms inside
megatron's attention and MLP modules here: the adapters' terms must land before them); Gemma's embedding is scaled and
tied to the LM head, OLMo 2's q / k norms span all heads (their weights split over TP).

Checked against PEFT on the transformers model, from adapters PEFT wrote (every factor, magnitude and modules_to_save
tensor moved off its initial value), at TP=2 + SP, PP=2 and CP=2: logits (1e-4) and loss (1e-5), every A / B /
magnitude gradient at HF shape (1e-5; not under PP), PEFT's trainable counts, greedy cached ``generate`` (PEFT's
tokens, scores 1e-4), the adapter saved again bit for bit, the adapter folder in PEFT and the merged export in
transformers (1e-4), ``merge_and_unload`` (1e-4). The post norms (and OLMo 2's split q / k norms) are trained
through ``modules_to_save``.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_dora import DORA_KW, model_checks
from ._lora_load import write_peft_adapter

POST_NORMS = ["post_attention_layernorm", "post_feedforward_layernorm"]
ADAPTERS = {
    "gemma3": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                            modules_to_save=POST_NORMS), "dora": DORA_KW},
    "olmo2": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                           modules_to_save=[*POST_NORMS, "q_norm", "k_norm"]), "dora": DORA_KW},
}
LAYOUTS = {"tp2_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
           "pp2": (2, {"pipeline_parallel_size": 2}), "cp2": (2, {"context_parallel_size": 2})}


@pytest.fixture(scope="module", params=list(ADAPTERS))
def model(request, tmp_path_factory):
    arch = request.param
    base = tmp_path_factory.mktemp(f"{arch}-lora")
    folder = make_tiny_checkpoint(base / "src", arch)
    adapters = {}
    for name, kw in ADAPTERS[arch].items():
        write_peft_adapter(str(folder), str(base / name), kw)
        adapters[name] = str(base / name)
    return str(folder), adapters, base


def _checks(folder: str, adapters: dict, out_dir: str, layout: dict) -> dict:
    return {name: model_checks(folder, adapter, f"{out_dir}/{name}", layout) for name, adapter in adapters.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapters_match_peft(model, layout):
    folder, adapters, base = model
    nprocs, sizes = LAYOUTS[layout]
    results = run_distributed(_checks, nprocs, folder, adapters, str(base / layout), sizes, timeout=400)
    for name in adapters:
        rank0 = results[0][name]
        assert rank0["counts"] == rank0["peft_counts"], name
        assert rank0["targets"] == 7 * 4, name  # NOTE: q, k, v, o, gate, up, down of 4 layers
        assert rank0["adapter_vs_base_logits"] > 1e-2, name  # the adapter changes the logits
        assert rank0["same_tensors"], name
        assert rank0["adapter_logits_diff"] < 1e-4 and rank0["merged_logits_diff"] < 1e-4, (name, rank0)
        for r in results:
            res = r[name]
            assert res["generate_same_tokens"] and res["generate_scores_diff"] < 1e-4, (name, res)
            assert res["merge_and_unload_diff"] < 1e-4, (name, res)
            assert res["unchanged_after_merged_export"], name
            if sizes.get("pipeline_parallel_size", 1) == 1:
                # A and B of 28 adapters, DoRA's magnitudes too
                assert res["grads_compared"] == 28 * (3 if name == "dora" else 2), (name, res["grads_compared"])
