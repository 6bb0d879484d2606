"""transformers' router load-balancing loss and router_logits (Qwen3-MoE, output_router_logits,
router_aux_loss_coef=0.1) under the 4-process products of the layouts ``test_moe_trainer_parity.py`` tests on 1 and
2 processes. One 4-process world runs them one after another (``_router_aux.four_processes``), every rank's results
compared:

- LoongTrainer's logged losses (4 steps, which include coef * aux summed over the step's micro-batches) within 1e-5
  relative (measured: 2e-7 at most) of one process's, which a one-process world of this module trains:
  - model parallel only, the same batches: PP4 (the first stage without a MoE layer: the middle stages add what
    the stage before handed on) and PP2 x TP2 + sequence parallel repeat the plain run (2-row micro-batches, 2 a
    step), and PP2 x CP2 under activation recompute the RECOMPUTE run (4 one-row micro-batches a step); the
    evaluation loss too;
  - data parallel 2 (EP2 implies it) with half the accumulation steps repeats one process's run: rank r takes the
    loader's micro-batches r, r + 2, ..., so a step trains the same micro-batches, and transformers.Trainer's
    ``coef * aux`` is summed over micro-batches and ranks (the EP2 reference in ``test_moe_trainer_parity.py``):
    TP2 + SP x EP2 (accumulation 1; the plain run's 2), and under activation recompute PP2 x DP2, PP2 x EP2
    and PP2 x VPP2 x DP2 (accumulation 2; the RECOMPUTE run's 4; the interleaved schedule runs several forwards
    before their backwards). Evaluation has no full batch under DP2 (4 rows each, 8 a batch): the training losses only;
- the model's forward against transformers' (1e-5): at TP2 + SP x CP2 the full forward checks of the 2-process
  tests (loss, aux_loss and router_logits with and without pads, coef 0, the keyword, the routers' gradients); at
  PP4, PP2 x TP2 + SP and PP2 x CP2 (pipelined: without a graph) loss, aux_loss and the router logits, detached,
  on every rank.
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._router_aux import RECOMPUTE, four_processes
from ._router_checks import assert_forward, assert_forward_values
from ._train_parity import train_loong


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_products")
    src = make_tiny_checkpoint(tmp / "src", "qwen3_moe", tokenizer=False, output_router_logits=True,
                               router_aux_loss_coef=0.1)
    one = run_distributed(train_loong, 1, str(src), str(tmp / "one"), {}, timeout=300)[0]
    recompute = run_distributed(train_loong, 1, str(src), str(tmp / "recompute"), {}, RECOMPUTE, timeout=300)[0]
    four = run_distributed(four_processes, 4, str(src), str(tmp / "four"), timeout=600)
    return one["losses"], recompute["losses"], four


def test_model_parallel_products_match_one_process(runs):
    one, recompute, four = runs
    assert len(one) == len(recompute) == 5 and None not in one + recompute
    for r in four:
        assert r["pp4"]["losses"] == pytest.approx(one, rel=1e-5), (r["pp4"], one)
        assert r["pp2_tp2"]["losses"] == pytest.approx(one, rel=1e-5), (r["pp2_tp2"], one)
        assert r["pp2_cp2"]["losses"] == pytest.approx(recompute, rel=1e-5), (r["pp2_cp2"], recompute)


def test_data_parallel_products_match_one_process(runs):
    one, recompute, four = runs
    for r in four:
        assert r["tp2_ep2"]["losses"][:4] == pytest.approx(one[:4], rel=1e-5), (r["tp2_ep2"], one)
        for name in ("pp2_dp2", "pp2_ep2", "pp2_vpp2_dp2"):
            assert r[name]["losses"][:4] == pytest.approx(recompute[:4], rel=1e-5), (name, r[name], recompute)


def test_forward_products_match_transformers(runs):
    for r in runs[2]:
        assert_forward(r["forward_tp2_cp2"])
        for name in ("forward_pp4", "forward_pp2_tp2", "forward_pp2_cp2"):
            # NOTE: a pipelined forward runs without a graph: its router logits are detached
            assert_forward_values(r[name], grad=False)
