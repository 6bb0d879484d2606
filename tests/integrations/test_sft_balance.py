"""DP load balancing under LoongSFTTrainer: TRL's collator in padding-free mode, DP=2 on CPU (gloo).

The tiny Llama trains 5 steps on pre-tokenized documents of long-tailed lengths (12 to 300 tokens, the data of
tests/trainer/test_dp_balance_trainer.py) with ``LoongSFTConfig(padding_free=True)``, balanced and with
``dp_load_balance=False``. Balancing only moves samples between the ranks of a step, and the loss is summed per label
token and divided by the step's global label-token count, so the two runs differ only in fp32 summation order: logged
losses within 1e-5 relative, trained weights within 1e-5 absolute (the tolerances of the LoongTrainer test). TRL's
``num_tokens`` (the tokens seen, summed over the ranks) is the same in both runs and equals the tokens the
unbalanced run trained.

TRL's collator pads each row to a multiple of 8 (``pad_to_multiple_of``): the balanced run's rows hold other padding
than the unbalanced run's, and ``num_tokens`` / Trainer's ``num_input_tokens_seen`` (padding included) still count
the rows as collated where the samples were drawn (``balanced_data.padded_row_tokens``), as TRL / Trainer count them
without balancing. Per step, each rank's tokens (the micro-batches it trains, padding included) and label tokens
(no padding) are recorded. Token imbalance is max rank label tokens / mean rank label tokens. The balancer evens
predicted cost (a·L² + b·L + c), not tokens, so tokens need not be exactly even: the bound asserted is 1.1 on every
balanced step, and the balanced run's worst step must beat the unbalanced run's worst step (asserted > 1.5: the data
is skewed enough to matter).

The same world also builds (without training) the train loader of a padded run (``padding_free=False``), which must
stay unbalanced, and of a bfd-packed run (padding-free by TRL's rule), which must be balanced; one step of the packed
loader is read to check its micro-batches come out of TRL's collator with the packed documents' restarting positions.
"""

from __future__ import annotations

import pytest
import torch

from loongforge_hf.testing.round_trip import read_all
from tests.trainer._dp_balance import long_tailed_docs, run_two_ranks

from ._sft_parity import _tokenizer

STEPS = 5
TOKEN_IMBALANCE_BOUND = 1.1
PAD_MULTIPLE = 8  # NOTE: TRL's collator pads each padding-free row to a multiple of 8


def _config(out_dir: str, **overrides):
    import loongforge_hf as lf

    kw = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
              learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5,
              logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
              disable_tqdm=True, gradient_checkpointing=False, padding_free=True, max_length=None,
              pad_to_multiple_of=PAD_MULTIPLE, include_num_input_tokens_seen="all")
    kw.update(overrides)
    return lf.LoongSFTConfig(**kw)


def _trainer(folder: str, args, docs=None):
    import datasets

    import loongforge_hf as lf

    class Recording(lf.LoongSFTTrainer):
        """Records this rank's tokens per optimizer step (the micro-batches the training loop hands the engine)."""

        def _check_batches_everywhere(self, micro, max_positions, failed=None):
            self.step_tokens.append(sum(int(b["input_ids"].numel()) for b in micro))  # NOTE: padding included
            self.step_labels.append(sum(int((b["labels"] != -100).sum()) for b in micro))  # NOTE: no padding
            return super()._check_batches_everywhere(micro, max_positions, failed=failed)

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ds = datasets.Dataset.from_dict({"input_ids": long_tailed_docs() if docs is None else docs})
    trainer = Recording(model=model, args=args, train_dataset=ds, processing_class=_tokenizer(folder))
    trainer.step_tokens, trainer.step_labels = [], []
    return trainer


def _train(folder: str, out_dir: str, **overrides) -> dict:
    from loongforge_hf.trainer.balanced_data import BalancedDataLoader

    trainer = _trainer(folder, _config(out_dir, **overrides))
    trainer.train()
    trainer.save_model(out_dir + "/final")
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "num_tokens": [h["num_tokens"] for h in logs],
            "tokens_seen": [h["num_input_tokens_seen"] for h in logs],
            "step_tokens": list(trainer.step_tokens), "step_labels": list(trainer.step_labels),
            "imbalance": [(h["dp_imbalance_before"], h["dp_imbalance_after"]) for h in logs
                          if "dp_imbalance_before" in h],
            "balanced_loader": isinstance(trainer.callback_handler.train_dataloader, BalancedDataLoader)}


def _loader_only(folder: str, out_dir: str, **overrides) -> dict:
    """The train loader LoongSFTTrainer builds, and the keys and positions of its first step's batches."""
    from loongforge_hf.trainer.balanced_data import BalancedDataLoader

    trainer = _trainer(folder, _config(out_dir, **overrides))
    loader = trainer.get_train_dataloader()
    out = {"balanced_loader": isinstance(loader, BalancedDataLoader),
           "collator_padding_free": trainer.data_collator.padding_free}
    if out["balanced_loader"]:
        iterator = iter(loader)
        micro = [next(iterator) for _ in range(2)]
        out["keys"] = sorted(micro[0])
        out["rows"] = [tuple(b["input_ids"].shape) for b in micro]
        out["documents_per_row"] = [int((b["position_ids"] == 0).sum()) for b in micro]
        out["rows_in_dataset"] = len(loader.dataset)
    return out


def sft_balanced_and_not(folder: str, out_dir: str) -> dict:
    return {"balanced": _train(folder, out_dir + "/balanced", dp_load_balance=True),
            "unbalanced": _train(folder, out_dir + "/unbalanced", dp_load_balance=False),
            "padded": _loader_only(folder, out_dir + "/padded", padding_free=False, max_length=512),
            "packed": _loader_only(folder, out_dir + "/packed", padding_free=False, packing=True,
                                   packing_strategy="bfd", max_length=128)}


def _token_imbalance(per_rank: list[dict], run: str) -> list[float]:
    steps = zip(*(result[run]["step_labels"] for result in per_rank))
    return [max(tokens) / (sum(tokens) / len(tokens)) for tokens in steps]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_two_ranks(tmp_path_factory, "sft-balance", sft_balanced_and_not)


def test_balanced_sft_equals_unbalanced_sft(runs):
    out, per_rank = runs
    for result in per_rank:
        assert result["balanced"]["balanced_loader"] and not result["unbalanced"]["balanced_loader"]
        assert len(result["balanced"]["losses"]) == STEPS
        assert result["balanced"]["losses"] == per_rank[0]["balanced"]["losses"]  # one global loss on every rank
        assert result["balanced"]["losses"] == pytest.approx(result["unbalanced"]["losses"], rel=1e-5)
        # TRL's num_tokens and Trainer's num_input_tokens_seen (over the data-parallel ranks, padding included): the
        # rows as TRL's collator makes them where the step's samples are drawn, wherever they train
        assert result["balanced"]["num_tokens"] == result["unbalanced"]["num_tokens"]
        assert result["balanced"]["tokens_seen"] == result["unbalanced"]["tokens_seen"]
        drawn = sum(map(sum, zip(*(r["unbalanced"]["step_tokens"] for r in per_rank))))
        assert result["balanced"]["num_tokens"][-1] == result["balanced"]["tokens_seen"][-1] == drawn
        # NOTE: the balanced rows hold other padding (what the counts must not follow)
        assert sum(map(sum, zip(*(r["balanced"]["step_tokens"] for r in per_rank)))) != drawn
    balanced, unbalanced = read_all(out / "balanced" / "final"), read_all(out / "unbalanced" / "final")
    assert balanced and sorted(balanced) == sorted(unbalanced)
    for name in balanced:
        torch.testing.assert_close(balanced[name], unbalanced[name], rtol=0, atol=1e-5, msg=name)


def test_balanced_sft_evens_the_tokens_per_rank(runs):
    _, per_rank = runs
    for run in ("balanced", "unbalanced"):
        assert all(len(result[run]["step_labels"]) == STEPS for result in per_rank)
    # the same samples per step: the ranks' label-token totals (no padding) agree step by step
    totals = [sum(tokens) for tokens in zip(*(r["balanced"]["step_labels"] for r in per_rank))]
    assert totals == [sum(tokens) for tokens in zip(*(r["unbalanced"]["step_labels"] for r in per_rank))]
    balanced, unbalanced = _token_imbalance(per_rank, "balanced"), _token_imbalance(per_rank, "unbalanced")
    assert max(unbalanced) > 1.5  # the data is skewed enough to matter
    assert max(balanced) < TOKEN_IMBALANCE_BOUND, balanced
    assert max(balanced) < max(unbalanced)
    for before, after in per_rank[0]["balanced"]["imbalance"]:
        assert after <= before


def test_padded_batches_stay_unbalanced_and_bfd_packing_is_balanced(runs):
    _, per_rank = runs
    for result in per_rank:
        assert result["padded"] == {"balanced_loader": False, "collator_padding_free": False}
        packed = result["packed"]
        assert packed["balanced_loader"] and packed["collator_padding_free"]
        assert {"input_ids", "labels", "position_ids", "cu_seq_lens_q"} <= set(packed["keys"])
        assert "attention_mask" not in packed["keys"]
        assert all(rows == 1 for rows, _ in packed["rows"])  # one flattened row per micro-batch
        assert packed["rows_in_dataset"] < 48  # bfd packed several documents into each example
        assert max(packed["documents_per_row"]) > 2  # each row's position_ids restart at every packed document


def test_packing_collators_are_recognised_by_class_and_padding_free():
    from transformers import DataCollatorWithFlattening
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from loongforge_hf.trainer.balanced_data import packs_without_padding

    class DataCollatorForLanguageModelingLookalike:  # TRL's name and attribute, not TRL's class
        padding_free = True

    assert packs_without_padding(DataCollatorWithFlattening())
    assert packs_without_padding(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True))
    assert not packs_without_padding(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=False))
    assert not packs_without_padding(DataCollatorForLanguageModeling(pad_token_id=0, return_position_ids=True))
    assert not packs_without_padding(DataCollatorForLanguageModelingLookalike())
    assert not packs_without_padding(None)
