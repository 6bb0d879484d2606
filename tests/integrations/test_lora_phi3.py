"""LoRA and DoRA on Phi-3, whose checkpoint packs q / k / v into ``qkv_proj`` and gate / up into ``gate_up_proj``.

PEFT gives each packed linear one adapter (one A, one B over all its rows); here B's rows (and DoRA's magnitude) are
permuted into megatron's fused ``linear_qkv`` / ``linear_fc1`` order as the weight's are, each TP rank holding those
of its own heads / MLP rows. Checked against PEFT on the transformers model, from adapters PEFT wrote (every factor,
magnitude and modules_to_save tensor moved off its initial value, so no term can hide behind a zero) at TP=1, TP=2,
TP=2 + SP, PP=2 and CP=2: logits (1e-4) and loss (1e-5), every A / B / magnitude gradient at HF shape (1e-5; not
under PP, where the loss is on the last stage only), PEFT's trainable counts, greedy cached ``generate`` (PEFT's
tokens, scores 1e-4), the adapter saved again bit for bit, the adapter folder in PEFT and the merged export in
transformers (1e-4), ``merge_and_unload`` (1e-4). get_peft_model's initial adapters: ``test_lora.py``'s "phi3" case.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from ._lora_dora import DORA_KW, adapters_checks, assert_adapters_match_peft, write_adapters

LORA_KW = dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
               init_lora_weights=False, modules_to_save=["post_attention_layernorm"])
ADAPTERS = {"lora": LORA_KW, "dora": DORA_KW}
LAYOUTS = {"tp1": (1, {}), "tp2": (2, {"tensor_parallel_size": 2}),
           "tp2_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
           "pp2": (2, {"pipeline_parallel_size": 2}), "cp2": (2, {"context_parallel_size": 2})}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    base = tmp_path_factory.mktemp("phi3-lora")
    return (*write_adapters(base, "phi3", ADAPTERS), base)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_linears_match_peft(phi3, layout):
    folder, adapters, base = phi3
    nprocs, sizes = LAYOUTS[layout]
    results = run_distributed(adapters_checks, nprocs, folder, adapters, str(base / layout), sizes, timeout=400)
    # NOTE: qkv_proj, o_proj, gate_up_proj, down_proj of 4 layers
    assert_adapters_match_peft(results, targets=4 * 4, pipeline=sizes.get("pipeline_parallel_size", 1) > 1)
