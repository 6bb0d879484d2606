"""DP load balancing inside LoongTrainer: DP=2 on CPU, packed documents with long-tailed lengths.

Balancing moves samples between data-parallel ranks within a step, and the loss is summed per token and divided by the
step's global token count, so balanced and unbalanced training differ only in fp32 summation order. Tolerances:
logged losses within 1e-5 relative, trained weights within 1e-5 absolute.
"""

import pytest
import torch

from loongforge_hf.testing.round_trip import read_all

from ._dp_balance import run_two_ranks, train_balanced_and_not

TOLERANCE = 0.02  # balanced_data.DEFAULT_TOLERANCE: steps within it are left as they are


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_two_ranks(tmp_path_factory, "dpb", train_balanced_and_not)


def test_balanced_training_equals_unbalanced_training(runs):
    out, per_rank = runs
    for result in per_rank:
        assert result["balanced"]["losses"] == per_rank[0]["balanced"]["losses"]  # one global loss on every rank
        assert len(result["balanced"]["losses"]) == 5
        assert result["balanced"]["losses"] == pytest.approx(result["unbalanced"]["losses"], rel=1e-5)
    balanced, unbalanced = read_all(out / "balanced" / "final"), read_all(out / "unbalanced" / "final")
    assert sorted(balanced) == sorted(unbalanced)
    for name in balanced:
        torch.testing.assert_close(balanced[name], unbalanced[name], rtol=0, atol=1e-5, msg=name)


def test_imbalance_is_logged_and_lowered(runs):
    _, per_rank = runs
    for result in per_rank:
        run = result["balanced"]
        assert {"dp_imbalance_before", "dp_imbalance_after", "tokens_per_second"} <= set(run["keys"])
        assert len(run["imbalance"]) == 5
        assert run["imbalance"] == per_rank[0]["balanced"]["imbalance"]
        for before, after in run["imbalance"]:
            assert after <= before
            if before > 1 + TOLERANCE:
                assert after < before
        assert max(before for before, _ in run["imbalance"]) > 1.2  # the data is skewed enough to matter
        assert max(after for _, after in run["imbalance"]) < 1.1


def test_balancing_is_off_with_one_data_parallel_rank_and_when_disabled(runs):
    _, per_rank = runs
    for result in per_rank:
        assert result["balanced"]["balanced_loader"]
        for name in ("unbalanced", "dp1"):  # dp_load_balance=False on DP=2; TP=2 leaves one DP rank
            assert not result[name]["balanced_loader"]
            assert result[name]["imbalance"] == []
            assert "dp_imbalance_before" not in result[name]["keys"]


def test_refit_cost_model_is_shared_by_all_ranks_and_keeps_the_gradient(runs):
    out, per_rank = runs
    flop_model = per_rank[0]["balanced"]["cost"]
    refit = per_rank[0]["refit"]["cost"]
    assert refit != flop_model and all(v >= 0 for v in refit) and any(v > 0 for v in refit)
    for result in per_rank:
        assert result["refit"]["cost"] == refit  # bit-identical: ranks must agree on every assignment
        assert result["refit"]["losses"] == pytest.approx(result["unbalanced"]["losses"], rel=1e-5)
    refit_weights, unbalanced = read_all(out / "refit" / "final"), read_all(out / "unbalanced" / "final")
    for name in refit_weights:
        torch.testing.assert_close(refit_weights[name], unbalanced[name], rtol=0, atol=1e-5, msg=name)


def test_ranks_that_read_different_lengths_stop_together_with_a_message(runs):
    _, per_rank = runs
    for result in per_rank:
        assert "ranks disagree on this step's sample lengths" in result["mismatch"]
        assert "dp_load_balance=False" in result["mismatch"]
