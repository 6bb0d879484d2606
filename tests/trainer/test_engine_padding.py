"""LoongTrainer pads micro-batches for megatron itself (trainer/data.py: pad_micro_batches): odd lengths under
sequence parallelism (seq % TP), under context parallelism (seq % 2 CP, the padding mask cut to each rank's queries)
and micro-batches of different lengths within one pipelined step train exactly like one rank on the unpadded batches
(losses within 1e-5 relative); so does evaluation on batches of odd lengths (the model's forward pads them
the same way)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _train(folder: str, out_dir: str, layouts: dict) -> dict:
    import datasets
    import transformers

    import loongforge_hf as lf
    from tests.trainer._packing import PadCollator, docs
    from tests.trainer._train_parity import losses_of

    result = {}
    for name, layout in layouts.items():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        args = transformers.TrainingArguments(output_dir=f"{out_dir}/{name}", per_device_train_batch_size=2,
                                              gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-3,
                                              logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True,
                                              disable_tqdm=True, remove_unused_columns=False)
        trainer = lf.LoongTrainer(model=model, args=args, data_collator=PadCollator(),
                                  train_dataset=datasets.Dataset.from_dict({"input_ids": docs(12)}))
        lengths = [PadCollator()([{"input_ids": d} for d in docs(12)[i:i + 2]])["input_ids"].shape[1]
                   for i in range(0, 12, 2)]
        trainer.train()
        # evaluation batches of odd lengths too: the model's forward pads them for megatron as the engine does
        evaluated = trainer.evaluate(datasets.Dataset.from_dict({"input_ids": docs(6, seed=9)}))["eval_loss"]
        result[name] = {"losses": losses_of(trainer.state.log_history), "lengths": lengths, "eval": evaluated}
        del trainer, model
    return result


def test_odd_and_unequal_lengths_are_padded_for_megatron(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "src", "qwen3")
    ref = run_distributed(_train, 1, str(folder), str(tmp_path / "one"), {"tp1": {}}, timeout=240)[0]["tp1"]
    layouts = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
               "pp2": {"pipeline_parallel_size": 2},
               "cp2": {"context_parallel_size": 2}}
    results = run_distributed(_train, 2, str(folder), str(tmp_path / "two"), layouts, timeout=400)
    # the data must exercise the padding: odd lengths, and micro-batches of one step with different lengths
    assert any(n % 2 for n in ref["lengths"]) and len(set(ref["lengths"][:2])) == 2, ref["lengths"]
    assert len(ref["losses"]) == 3
    for r in results:
        for name in layouts:
            assert r[name]["losses"] == pytest.approx(ref["losses"], rel=1e-5), (name, r[name], ref)
            assert r[name]["eval"] == pytest.approx(ref["eval"], rel=1e-5), (name, r[name], ref)


def test_trl_padding_free_batches_are_padded_without_their_boundary_keys():
    """TRL's padding-free collator adds varlen-kernel boundaries derived from position_ids; a padded batch drops
    them (megatron reads the documents from position_ids) instead of being left unpadded."""
    import trl

    from loongforge_hf.trainer.data import pad_micro_batches

    collate = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    micro = [collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]), collate([{"input_ids": [5, 6, 7, 8]}])]
    assert "cu_seq_lens_q" in micro[0]
    padded = pad_micro_batches(micro, multiple=2, same_length=True)
    assert [b["input_ids"].shape[1] for b in padded] == [6, 6]
    assert all(set(b) == {"input_ids", "labels", "position_ids"} for b in padded)
    assert padded[0]["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert padded[1]["labels"][0, 4:].tolist() == [-100, -100]
    # already of the lengths megatron needs: returned as the collator made them
    assert "cu_seq_lens_q" in pad_micro_batches(micro[:1], multiple=1, same_length=False)[0]
