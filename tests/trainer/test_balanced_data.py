"""DP load balancing in the data path, without megatron: step plans, the balanced loader against accelerate's shards,
the cost model from HF configs, the compute timer, and LoongTrainingArguments."""

import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from loongforge_hf.trainer.balance import CostModel
from loongforge_hf.trainer.balance_refit import ComputeTimer
from loongforge_hf.trainer.balanced_data import BalancedDataLoader, cost_model_for, plan_step
from loongforge_hf.trainer.data import DataError

# The FLOP model of the tiny Llama used by the trainer tests (per-sample overhead of 64 tokens).
TINY = CostModel(a=1536.0, b=815232.0, c=64 * 815232.0)


def _check_plan(plan, lengths, cost=TINY):
    """Every sample exactly once, micro-batch count kept, none empty, none longer than the longest unbalanced one."""
    flat = [n for rank in lengths for micro in rank for n in micro]
    positions = sorted(p for rank in plan.micro_batches for micro in rank for p in micro)
    assert positions == list(range(len(flat)))
    cap = max(sum(micro) for rank in lengths for micro in rank)
    for rank in plan.micro_batches:
        assert len(rank) == len(lengths[0])
        for micro in rank:
            assert micro and list(micro) == sorted(micro)
            assert sum(flat[p] for p in micro) <= cap
    costs = cost(np.asarray(flat))
    rank_costs = [sum(costs[p] for micro in rank for p in micro) for rank in plan.micro_batches]
    assert max(rank_costs) / np.mean(rank_costs) == pytest.approx(plan.imbalance_after, rel=1e-9)
    assert plan.imbalance_after <= plan.imbalance_before


def test_plan_moves_a_long_document_off_a_crowded_rank():
    lengths = [[[300, 12], [14, 13]], [[12, 15], [16, 14]]]
    plan = plan_step(lengths, cost=TINY)
    _check_plan(plan, lengths)
    assert plan.rebalanced
    assert plan.imbalance_before > 1.4
    # the best this step allows: the 300-token document with the cheapest other one (each rank keeps 2 micro-batches)
    flat = [n for rank in lengths for micro in rank for n in micro]
    long_rank = next(r for r in range(2) if 0 in plan.rank_positions(r))
    assert sorted(flat[p] for p in plan.rank_positions(long_rank)) == [12, 300]
    assert plan.imbalance_after < 1.13


def test_plan_keeps_a_balanced_step_exactly():
    lengths = [[[20, 20], [20, 20]], [[20, 20], [20, 20]], [[20, 20], [20, 20]]]
    plan = plan_step(lengths, cost=TINY)
    assert not plan.rebalanced
    assert plan.imbalance_before == plan.imbalance_after == pytest.approx(1.0)
    assert plan.micro_batches == (((0, 1), (2, 3)), ((4, 5), (6, 7)), ((8, 9), (10, 11)))


def test_plan_within_tolerance_is_kept():
    lengths = [[[20, 21]], [[20, 20]]]
    assert not plan_step(lengths, cost=TINY, tolerance=0.02).rebalanced
    assert plan_step([[[200, 21]], [[20, 20]]], cost=TINY, tolerance=0.02).rebalanced


def test_every_rank_keeps_one_sample_per_micro_batch_even_next_to_a_huge_one():
    lengths = [[[500, 10], [10, 10]], [[10, 10], [10, 10]]]
    plan = plan_step(lengths, cost=TINY)
    _check_plan(plan, lengths)
    assert all(len(rank) == 2 and all(rank) for rank in plan.micro_batches)


@pytest.mark.parametrize("seed", range(40))
def test_random_steps_keep_samples_micro_batches_and_memory_and_never_get_slower(seed):
    rng = np.random.default_rng(seed)
    ranks, micro, per = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    lengths = [[(np.minimum(8 / rng.uniform(size=per) ** 1.25, 2000)).astype(int).tolist() for _ in range(micro)]
               for _ in range(ranks)]
    plan = plan_step(lengths, cost=TINY)
    _check_plan(plan, lengths)
    if not plan.rebalanced:
        assert plan.imbalance_after == plan.imbalance_before


def test_plan_rejects_ragged_steps():
    with pytest.raises(ValueError, match="same number of micro-batches"):
        plan_step([[[1], [2]], [[3]]], cost=TINY)
    with pytest.raises(ValueError, match="no samples"):
        plan_step([[[1], []], [[3], [4]]], cost=TINY)


def test_fingerprint_tells_assignments_apart():
    lengths = [[[300, 12], [14, 13]], [[12, 15], [16, 14]]]
    flat = [n for rank in lengths for micro in rank for n in micro]
    balanced = plan_step(lengths, cost=TINY)
    kept = plan_step(lengths, cost=TINY, tolerance=10.0)
    assert balanced.fingerprint(flat) == plan_step(lengths, cost=TINY).fingerprint(flat)
    assert balanced.fingerprint(flat) != kept.fingerprint(flat)
    assert kept.fingerprint(flat) != kept.fingerprint([n + 1 for n in flat])


# ---- the loader against accelerate's shards -----------------------------------------------------------------------
def _dataset(lengths):
    import datasets

    return datasets.Dataset.from_dict({"input_ids": [[5] * n for n in lengths], "idx": list(range(len(lengths)))})


def _long_tailed(n, seed=0):
    rng = np.random.default_rng(seed)
    return np.minimum(10 / rng.uniform(size=n) ** 1.25, 400).astype(int).tolist()


class _Indices:
    """A collator that returns the examples' dataset indices, so batches can be compared as sets."""

    def __call__(self, examples):
        return [e["idx"] for e in examples]


def _shard(ds, *, rank, ranks, batch_size, drop_last, shuffle, num_workers=0):
    from accelerate.data_loader import prepare_data_loader

    sampler = RandomSampler(ds) if shuffle else SequentialSampler(ds)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=_Indices(), drop_last=drop_last,
                        num_workers=num_workers)
    return prepare_data_loader(loader, num_processes=ranks, process_index=rank, put_on_device=False,
                               even_batches=True, use_seedable_sampler=True, data_seed=11)


@pytest.mark.parametrize("ranks,batch_size,ga,drop_last,shuffle,num_workers", [
    (2, 2, 2, False, True, 0), (2, 3, 2, True, True, 0), (3, 2, 3, False, True, 2), (4, 1, 4, False, False, 0),
    (2, 1, 1, False, True, 0)])
def test_each_step_trains_the_unbalanced_steps_samples(ranks, batch_size, ga, drop_last, shuffle, num_workers):
    ds = _dataset(_long_tailed(37))
    reference = [_shard(ds, rank=r, ranks=ranks, batch_size=batch_size, drop_last=drop_last, shuffle=shuffle)
                 for r in range(ranks)]
    balanced = [BalancedDataLoader(_shard(ds, rank=r, ranks=ranks, batch_size=batch_size, drop_last=drop_last,
                                          shuffle=shuffle, num_workers=num_workers),
                                   rank=r, num_ranks=ranks, micro_per_step=ga, collator=_Indices(), cost=TINY)
                for r in range(ranks)]
    rebalanced_steps = 0
    for epoch in (0, 3):  # the same loader objects, as the trainer uses them (epoch 3: as after a resume)
        for loader in reference + balanced:
            loader.set_epoch(epoch)
        want = [list(loader) for loader in reference]
        got, logs = [], []
        for loader in balanced:
            batches = []
            for batch in loader:
                batches.append(batch)
                if len(batches) % ga == 1 or ga == 1:
                    logs.append(dict(loader.step_logs))
            got.append(batches)
        assert all(len(g) == len(want[0]) == len(loader) for g, loader in zip(got, balanced))
        for step in range(0, len(want[0]), ga):
            unbalanced = sorted(i for rank in want for batch in rank[step:step + ga] for i in batch)
            trained = sorted(i for rank in got for batch in rank[step:step + ga] for i in batch)
            assert trained == unbalanced, (epoch, step)
            assert all(batch for rank in got for batch in rank[step:step + ga])
        rebalanced_steps += sum(log["dp_imbalance_after"] < log["dp_imbalance_before"] for log in logs)
        assert all(log["dp_imbalance_after"] <= log["dp_imbalance_before"] for log in logs)
    if ranks * batch_size * ga > 1 and ga * batch_size > 1:
        assert rebalanced_steps > 0


def test_without_skew_each_rank_gets_exactly_the_unbalanced_batches_in_order():
    ds = _dataset([16] * 24)
    for rank in range(2):
        expected = list(_shard(ds, rank=rank, ranks=2, batch_size=3, drop_last=False, shuffle=True))
        loader = BalancedDataLoader(_shard(ds, rank=rank, ranks=2, batch_size=3, drop_last=False, shuffle=True),
                                    rank=rank, num_ranks=2, micro_per_step=2, collator=_Indices(), cost=TINY)
        assert list(loader) == expected and len(expected) == 4
        assert loader.step_logs == {"dp_imbalance_before": 1.0, "dp_imbalance_after": 1.0}


def test_examples_without_input_ids_fail_with_a_message():
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["a b", "c"] * 4})
    loader = BalancedDataLoader(_shard(ds, rank=0, ranks=2, batch_size=1, drop_last=False, shuffle=False),
                                rank=0, num_ranks=2, micro_per_step=1, collator=_Indices(), cost=TINY)
    with pytest.raises(DataError, match="input_ids.*dp_load_balance=False"):
        next(iter(loader))


# ---- cost model from HF configs -----------------------------------------------------------------------------------
def test_cost_model_for_dense_gqa_config():
    import transformers

    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=24, vocab_size=203)
    assert cost_model_for(cfg) == CostModel.from_model_dims(
        hidden_size=64, num_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        intermediate_size=96, vocab_size=203)
    llama = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=203)
    assert cost_model_for(llama).a == CostModel.from_model_dims(
        hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        intermediate_size=96, vocab_size=203).a


def test_cost_model_for_moe_and_mla_configs():
    import transformers

    ds = transformers.DeepseekV3Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=16,
                                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                       vocab_size=203)
    assert cost_model_for(ds) == CostModel.from_model_dims(
        hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=24,
        intermediate_size=96, vocab_size=203, num_experts_per_tok=3, moe_intermediate_size=32)
    mixtral = transformers.MixtralConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, vocab_size=203)
    assert cost_model_for(mixtral) == CostModel.from_model_dims(
        hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=48, vocab_size=203, num_experts_per_tok=2, moe_intermediate_size=48)


def test_cost_model_for_falcon_configs():
    """Falcon's MLP width is ffn_hidden_size, its KV heads num_kv_heads (40B's groups) or one (7B's multi_query)."""
    from loongforge_hf.testing.tiny_models import _config

    for arch, kv in (("falcon", 2), ("falcon_mqa", 1)):
        assert cost_model_for(_config(arch)) == CostModel.from_model_dims(
            hidden_size=64, num_layers=4, num_attention_heads=4, num_key_value_heads=kv, head_dim=16,
            intermediate_size=96, vocab_size=203), arch


# ---- the compute timer (megatron's timers protocol) --------------------------------------------------------------
class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, name, log_level=None):
        recorder = self

        class _T:
            def start(self, barrier=False):
                recorder.calls.append((name, "start", barrier))

            def stop(self, barrier=False):
                recorder.calls.append((name, "stop", barrier))
        return _T()


def test_compute_timer_measures_schedule_start_to_gradient_sync_and_forwards_calls():
    class Config:
        timers = None

    config = Config()
    config.timers = inner = _Recorder()
    timer = ComputeTimer.install(config, torch.device("cpu"))
    assert ComputeTimer.install(config, torch.device("cpu")) is timer is config.timers
    assert timer.take() is None
    timer("forward-backward", log_level=1).start(barrier=True)
    time.sleep(0.05)
    timer("forward-compute", log_level=2).start()
    timer("all-grads-sync", log_level=1).start(barrier=True)
    time.sleep(0.3)  # waiting for the gradient reduction is not compute
    timer("all-grads-sync").stop()
    timer("forward-backward").stop()
    seconds = timer.take()
    assert 0.05 <= seconds < 0.3
    assert timer.take() is None
    assert ("forward-backward", "start", True) in inner.calls and ("all-grads-sync", "stop", False) in inner.calls
    assert ("forward-compute", "start", False) in inner.calls
    timer("forward-backward", log_level=1).start()  # a forward-only schedule: no gradient sync, no measurement
    timer("forward-backward").stop()
    assert timer.take() is None


def test_training_arguments_defaults_and_validation(tmp_path):
    from loongforge_hf import LoongTrainingArguments

    args = LoongTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert args.dp_load_balance is True and args.dp_balance_refit is False and args.dp_balance_refit_steps == 8
    with pytest.raises(ValueError, match="dp_balance_refit_steps"):
        LoongTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], dp_balance_refit_steps=0)
