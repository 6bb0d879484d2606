"""LoRA on DeepSeek-V2/V3 (multi-latent attention, shared experts, dense first layer) against PEFT.

PEFT adapts MLA's projections as plain linears (``q_proj`` or ``q_a_proj`` / ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_b_proj``, ``o_proj``) and, through its rewrite on transformers 5, the routed expert stacks and the router as
parameters; the expert names then leave the modules, so the shared experts and the dense first layer carry none.
Here each projection is one megatron linear (the down projections column-parallel too).

- Whole model against ``peft.get_peft_model`` on the transformers model: DeepSeek-V3 with ``q_lora_rank`` (the
  attention projections, ``kv_a_layernorm`` and the LM head trained whole; a multi-token-prediction layer in the
  checkpoint copied through the merged export), DeepSeek-V3 with rotary rows in halves on disk (``rope_interleave=
  False``: B's rows permuted as the weight's) and DeepSeek-V2 with ``"all-linear"``; at TP1, TP2 + sequence parallel
  (experts whole, expert_tensor_parallel_size=1), EP2 over a data-parallel pair, PP2 and CP2 x EP2 (gradients summed
  over the CP ranks, as megatron's DDP sums them): logits within 1e-4 (1e-5
  with expert or router adapters), loss within 1e-5, every attention adapter's gradient of layers 1-2 within 1e-5
  (one stage), PEFT's parameter counts, megatron's DDP holding the trainable tensors only, the adapter folder in
  ``PeftModel.from_pretrained`` and the merged export in transformers (1e-4), a PEFT-written adapter (random B)
  loaded with PEFT's logits and loss.
- LoongSFTTrainer with ``"all-linear"`` on DeepSeek-V3 (chat messages, assistant-only loss) against trl.SFTTrainer
  + PEFT: every logged loss within 1e-4 relative and TRL's token metrics, at TP1, TP2 + SP + EP2 and CP2 x EP2
  (both ranks logging the same), the saved adapter in PEFT with the trained logits (1e-3).
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_mla import (CHECKPOINTS, ONE_RANK_CASES, SFT_SCENARIOS, TWO_RANK_LAYOUTS, one_rank_checks,
                        two_rank_checks, write_peft_adapters)
from .test_lora_moe import _assert_model_matches_peft


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-mla")
    folders = {name: str(make_tiny_checkpoint(base / name, arch, **kw)) for name, (arch, kw) in CHECKPOINTS.items()}
    return folders, write_peft_adapters(folders, str(base)), base


@pytest.fixture(scope="module")
def one_rank(setup):
    folders, adapters, base = setup
    return run_distributed(one_rank_checks, 1, folders, str(base / "one"), adapters, timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(setup):
    folders, adapters, base = setup
    return run_distributed(two_rank_checks, 2, folders, str(base / "two"), adapters, timeout=600)


@pytest.mark.parametrize("case", list(ONE_RANK_CASES))
def test_tp1_matches_peft(one_rank, case):
    _assert_model_matches_peft([one_rank[case]], experts=case.endswith("/all_linear"))


@pytest.mark.parametrize("layout, case", [(name, case) for name, (_, cases) in TWO_RANK_LAYOUTS.items()
                                          for case in cases])
def test_two_ranks_match_peft(two_ranks, layout, case):
    _assert_model_matches_peft([r[f"{layout}/{case}"] for r in two_ranks], experts=case.endswith("/all_linear"))


@pytest.mark.parametrize("name", list(SFT_SCENARIOS))
def test_sft_matches_trl(one_rank, two_ranks, name):
    from ._sft_parity import assert_matches

    ref = one_rank["sft"]["trl"][name]
    assert_matches(name, ref, one_rank["sft"]["loong"][name], SFT_SCENARIOS)
    for key in ("sft", "sft_cp2_ep2"):
        for rank in two_ranks:
            assert rank[key][name]["losses"] == two_ranks[0][key][name]["losses"], key
        assert_matches(name, ref, two_ranks[0][key][name], SFT_SCENARIOS)
