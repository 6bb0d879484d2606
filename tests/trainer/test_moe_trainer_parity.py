"""LoongTrainer on a mixture-of-experts model (Qwen3-MoE, fp32) against transformers.Trainer and against itself on
one process: the logged losses of four steps.

- tp1: the same losses as transformers.Trainer (1e-5), the router's load-balancing loss off on both sides;
- tp2etp1: tensor parallel 2 with the experts whole on each rank (expert_tensor_parallel_size=1, sequence parallel)
  repeats the one-process losses (1e-5): the experts' gradients are reduced over the expert data-parallel group (the
  tensor-parallel ranks, each of which ran the experts on its own tokens), not the dense data-parallel group;
- a config with output_router_logits (router_aux_loss_coef=0.1): transformers' router load-balancing loss over all
  MoE layers of each forward (``bridges/router_balance.py``):
  - the model's forward returns transformers' loss (lm + coef * aux), aux_loss (1e-5) and router_logits (as many
    layers, shapes and dtypes, 1e-5, carrying grad as transformers': ``bridges/router_logits.py``), with and
    without an attention mask with pads, under no_grad without labels, and with router_aux_loss_coef=0 (aux_loss
    and router_logits still returned, the loss without the term); the routers get the term's gradient (1e-4 of the
    largest entry) as the caller backpropagates it (a scaled loss: scaled; loss - coef * aux: none), and an
    objective on the router logits alone gives them transformers' gradient (1e-4); the forward keyword
    output_router_logits=False turns it off (router_logits None), True turns it on over a config without it; for
    Mixtral, ERNIE 4.5 MoE and OLMoE too (one process; ERNIE's experts chosen with its expert bias, its balancing
    loss counting them without; OLMoE's top k not renormalised); at TP2 + sequence parallel and at CP2 too (the
    15-token batch is padded to 16 by the model: a pad that does not count, trimmed from the router logits; each
    rank's router gradient is its own tokens' part, summed over the ranks that split the tokens); under activation
    recompute the router logits are transformers' values, detached, and two forwards before one backward are
    refused;
  - LoongTrainer's logged losses (which include coef * aux, summed over the step's micro-batches) equal
    transformers.Trainer's (1e-5) on one process, for Qwen3-MoE, Mixtral, ERNIE 4.5 MoE and OLMoE, and TP2 +
    sequence parallel and CP2 repeat them (1e-5);
  - EP2 (2 processes: data parallel 2, the experts split over the two ranks) with gradient accumulation 1 repeats
    the one-process run with accumulation 2 (1e-5): the same 4 rows a step in the same 2-row micro-batches (rank r
    gets the loader's batch r). That is the right reference for transformers.Trainer's semantics
    (transformers 5.x ``training_step``/``compute_loss``): the model's loss is ``lm_sum / N + coef * aux`` per
    micro-batch with ``N`` the step's label tokens over all ranks, not divided by the accumulation steps (the
    model takes loss kwargs), multiplied by the number of processes (``average_tokens_across_devices``) before DDP
    averages the gradients; so ``coef * aux`` enters summed over micro-batches and ranks, and the logged loss (the
    ranks' mean) is the same sum: on one process with twice the accumulation, the same micro-batches' sum.
    The EP2 model's forward gives transformers' loss, aux_loss and router_logits (1e-5);
  - pipeline parallelism: PP2 repeats the one-process losses (1e-5), and PP2 with two virtual stages each (the
    first without a MoE layer) under activation recompute with 4 one-row micro-batches a step (several forwards
    in flight, layers recomputed in their backwards) repeats the one-process run with the same settings (1e-5);
    the PP2 and the PP2 x VPP2 forwards give transformers' loss, aux_loss and router_logits (1e-5; the router
    logits of every stage's layers, detached) on both ranks, the latter also after a forward of the first stage's
    chunk alone; the VPP layout reuses the PP2 layout's side-channel groups (the same pipelines).
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._router_aux import one_process, two_processes
from ._router_checks import assert_forward, assert_forward_values, assert_router_logits
from ._train_parity import train_hf, train_loong


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


@pytest.fixture(scope="module")
def router_aux(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_aux")
    src = make_tiny_checkpoint(tmp / "src", "qwen3_moe", tokenizer=False, output_router_logits=True,
                               router_aux_loss_coef=0.1)
    mixtral = make_tiny_checkpoint(tmp / "mixtral", "mixtral", tokenizer=False, output_router_logits=True,
                                   router_aux_loss_coef=0.1)
    # NOTE: ERNIE 4.5 MoE with 3 MoE layers (1-3): the balancing loss counts the top k without its expert bias
    ernie = make_tiny_checkpoint(tmp / "ernie", "ernie4_5_moe", tokenizer=False, output_router_logits=True,
                                 router_aux_loss_coef=0.1, moe_layer_end_index=3)
    olmoe = make_tiny_checkpoint(tmp / "olmoe", "olmoe", tokenizer=False, output_router_logits=True,
                                 router_aux_loss_coef=0.1)
    one = run_distributed(one_process, 1, str(src), str(tmp / "one"), str(mixtral), str(ernie), str(olmoe),
                          timeout=300)[0]
    return src, one


def test_router_aux_loss_recompute_of_two_forwards_is_refused(router_aux):
    said = router_aux[1]["recompute_two_forwards"]
    assert said is not None and "each forward's backward to run before the next forward" in said, said


def test_router_aux_loss_in_forward(router_aux):
    assert_forward(router_aux[1]["forward"])
    assert_forward(router_aux[1]["forward_mixtral"])
    assert_forward(router_aux[1]["forward_ernie"])
    assert_forward(router_aux[1]["forward_olmoe"])
    assert_router_logits(router_aux[1]["recompute_router"], grad=False)


def test_router_aux_loss_matches_transformers_trainer(router_aux):
    _, one = router_aux
    assert one["one"]["losses"] == pytest.approx(one["hf"], rel=1e-5, abs=1e-5)
    assert one["mixtral_one"]["losses"] == pytest.approx(one["mixtral_hf"], rel=1e-5, abs=1e-5)
    assert one["ernie_one"]["losses"] == pytest.approx(one["ernie_hf"], rel=1e-5, abs=1e-5)
    assert one["olmoe_one"]["losses"] == pytest.approx(one["olmoe_hf"], rel=1e-5, abs=1e-5)


def test_router_aux_loss_tp2_sp_ep2_cp2_pp2_vpp(router_aux, tmp_path):
    src, one = router_aux
    got = run_distributed(two_processes, 2, str(src), str(tmp_path / "lf"), timeout=500)
    for r in got:
        assert r["tp2"]["losses"][:4] == pytest.approx(one["one"]["losses"][:4], rel=1e-5, abs=1e-5)
        assert_forward(r["forward_tp2"])
        assert r["ep2"]["losses"][:4] == pytest.approx(one["one"]["losses"][:4], rel=1e-5, abs=1e-5)
        assert r["cp2"]["losses"] == pytest.approx(one["one"]["losses"], rel=1e-5, abs=1e-5)
        assert_forward(r["forward_cp2"])
        assert r["pp2"]["losses"] == pytest.approx(one["one"]["losses"], rel=1e-5, abs=1e-5)
        assert r["vpp_reuses_pp2_link"]
        assert r["vpp_recompute"]["losses"] == pytest.approx(one["recompute"]["losses"], rel=1e-5, abs=1e-5)
        for forward in ("forward_ep2", "forward_pp2", "forward_vpp", "forward_vpp_again"):
            # NOTE: a pipelined forward runs without a graph: its router logits are detached
            assert_forward_values(r[forward], grad=forward == "forward_ep2")
