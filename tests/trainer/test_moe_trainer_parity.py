"""LoongTrainer on a mixture-of-experts model (Qwen3-MoE, fp32) against transformers.Trainer and against itself on
one process: the logged losses of four steps.

- tp1: the same losses as transformers.Trainer (1e-5), the router's load-balancing loss off on both sides;
- tp2etp1: tensor parallel 2 with the experts whole on each rank (expert_tensor_parallel_size=1, sequence parallel)
  repeats the one-process losses (1e-5): the experts' gradients are reduced over the expert data-parallel group (the
  tensor-parallel ranks, each of which ran the experts on its own tokens), not the dense data-parallel group;
- a config with output_router_logits: transformers.Trainer adds its router load-balancing loss to the loss, which the
  megatron step does not compute (the model trains with megatron's per-layer balancing loss instead): LoongTrainer
  says so when it is built (LoongSFTTrainer refuses it: trl would add its own on top).
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._train_parity import router_aux_loss_warnings, train_hf, train_loong


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ref")
    src = make_tiny_checkpoint(tmp / "src", "qwen3_moe", tokenizer=False)
    hf = run_distributed(train_hf, 1, str(src), str(tmp / "hf"), timeout=300)[0]
    one = run_distributed(train_loong, 1, str(src), str(tmp / "lf"), {}, timeout=300)[0]
    return src, hf, one


def test_matches_transformers_trainer(reference):
    _, hf, one = reference
    assert len(one["losses"]) == len(hf) == 5
    assert one["losses"][:4] == pytest.approx(hf[:4], rel=1e-5, abs=1e-5)


def test_tp2_etp1_matches_one_process(reference, tmp_path):
    src, _, one = reference
    layout = {"tensor_parallel_size": 2, "expert_tensor_parallel_size": 1, "sequence_parallel": True}
    got = run_distributed(train_loong, 2, str(src), str(tmp_path / "lf"), layout, timeout=400)
    for r in got:
        assert r["losses"][:4] == pytest.approx(one["losses"][:4], rel=1e-5, abs=1e-5), (r["losses"], one["losses"])


def test_output_router_logits_is_announced(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3_moe", tokenizer=False, output_router_logits=True,
                               router_aux_loss_coef=0.1)
    messages = run_distributed(router_aux_loss_warnings, 1, str(src), str(tmp_path / "out"), timeout=300)[0]
    said = [m for m in messages if "output_router_logits" in m]
    assert len(said) == 1 and "coefficient 0.1" in said[0] and "transformers.Trainer" in said[0], messages
