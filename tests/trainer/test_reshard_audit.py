"""Resuming a TP2 checkpoint at TP1 where megatron's resharding cannot give the one-rank tensors back
(``trainer/checkpoint_layout.py``): DiffLlama's ``linear_qkv`` (each rank a slice of both halves of the heads: the
rows came back reordered, silently) and Falcon's single KV head replicated on both ranks (a shape error that blamed
the checkpoint) are refused by name, on every rank, before megatron's load. And a same-layout resume of Zamba2, whose
shared blocks megatron keyed as replicated (one rank's column / row shards saved for both), gives back the
checkpoint's weights bit for bit. One 2-rank world for all three."""

import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._train_parity import make_dataset, training_args


def _resume_at_tp1(folders: dict, root: str) -> dict:
    import loongforge_hf as lf
    from loongforge_hf.bridges.checkpoint_files import CheckpointError

    kw = dict(max_steps=1, save_strategy="steps", save_steps=1, gradient_accumulation_steps=1,
              per_device_train_batch_size=2, warmup_steps=0)
    out = {}
    for arch, folder in folders.items():
        if arch == "zamba2":
            continue
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                        sequence_parallel=True)
        lf.LoongTrainer(model=model, args=training_args(f"{root}/{arch}/tp2", **kw),
                        train_dataset=make_dataset(n=4)).train()
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = lf.LoongTrainer(model=model, args=training_args(f"{root}/{arch}/tp1", **kw),
                                  train_dataset=make_dataset(n=4))
        try:
            trainer.train(resume_from_checkpoint=f"{root}/{arch}/tp2/checkpoint-1")
            out[arch] = None
        except CheckpointError as err:
            out[arch] = str(err)
    layout = {"tensor_parallel_size": 2, "sequence_parallel": True}
    for step in ("tp2", "resumed"):
        model = lf.AutoModelForCausalLM.from_pretrained(folders["zamba2"], dtype=torch.float32, **layout)
        trainer = lf.LoongTrainer(model=model, args=training_args(f"{root}/zamba2/{step}", **kw),
                                  train_dataset=make_dataset(n=4))
        trainer.train(resume_from_checkpoint=f"{root}/zamba2/tp2/checkpoint-1" if step == "resumed" else None)
    trainer.save_model(f"{root}/zamba2/resumed/final")
    return out


def _weights(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_resume_refused_at_tp1_and_zamba2_same_layout_exact(tmp_path):
    folders = {arch: str(make_tiny_checkpoint(tmp_path / arch, arch)) for arch in ("diffllama", "falcon_mqa", "zamba2")}
    for rank in run_distributed(_resume_at_tp1, 2, folders, str(tmp_path / "runs"), timeout=300):
        assert "tensor_parallel_size=2, this run has 1" in (rank["diffllama"] or ""), rank
        assert "resharding is not supported for ['DifferentialSelfAttention']" in rank["diffllama"], rank
        assert "KV heads are replicated over tensor-parallel ranks (num_key_value_heads=1" in \
            (rank["falcon_mqa"] or ""), rank
        assert "cannot be resumed in this layout" in rank["falcon_mqa"], rank
    saved, resumed = (_weights(tmp_path / "runs" / "zamba2" / d) for d in ("tp2/checkpoint-1", "resumed/final"))
    assert sorted(saved) == sorted(resumed) and any(".shared_transformer." in k for k in saved)
    assert [k for k in saved if not torch.equal(saved[k], resumed[k])] == []
