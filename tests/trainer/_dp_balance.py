"""Rank functions for DP load balancing in LoongTrainer: packed long-tailed documents, balanced or not."""

import torch


MAX_POSITIONS = 1024  # the tiny checkpoints' 128 would cap a packed row of two documents


def long_tailed_docs(n: int = 48, seed: int = 7, vocab: int = 203, shortest: int = 12, longest: int = 300):
    """Token lists with Pareto lengths (shape 0.8): mostly tens of tokens, now and then hundreds."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    lengths = (shortest / u.pow(1 / 0.8)).clamp(max=longest).long().tolist()
    return [torch.randint(4, vocab, (L,), generator=g).tolist() for L in lengths]


def _args(out_dir: str, **overrides):
    import loongforge_hf as lf

    kw = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5,
              learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5,
              logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
              remove_unused_columns=False)
    kw.update(overrides)
    return lf.LoongTrainingArguments(**kw)


def _train(folder: str, out_dir: str, layout: dict, docs=None, **arg_overrides) -> dict:
    import datasets
    from transformers import DataCollatorWithFlattening

    import loongforge_hf as lf
    from loongforge_hf.trainer.balanced_data import BalancedDataLoader

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    ds = datasets.Dataset.from_dict({"input_ids": long_tailed_docs() if docs is None else docs})
    trainer = lf.LoongTrainer(model=model, args=_args(out_dir, **arg_overrides), train_dataset=ds,
                              data_collator=DataCollatorWithFlattening())
    trainer.train()
    trainer.save_model(out_dir + "/final")
    logs = [h for h in trainer.state.log_history if "loss" in h]
    loader = trainer.callback_handler.train_dataloader
    cost = getattr(loader, "cost", None)
    return {"losses": [h["loss"] for h in logs],
            "imbalance": [(h["dp_imbalance_before"], h["dp_imbalance_after"]) for h in logs
                          if "dp_imbalance_before" in h],
            "keys": sorted(logs[0]),
            "balanced_loader": isinstance(loader, BalancedDataLoader),
            "cost": None if cost is None else (cost.a, cost.b, cost.c)}


def train_balanced_and_not(folder: str, out_dir: str) -> dict:
    """On 2 ranks: DP=2 balanced, DP=2 with dp_load_balance=False, DP=2 with the cost model refit after 2 measured
    steps, TP=2 (one data-parallel rank), and DP=2 on a dataset whose lengths differ between ranks, in one world."""
    import torch.distributed as dist

    from loongforge_hf.trainer.data import DataError

    out = {"balanced": _train(folder, out_dir + "/balanced", {}),
           "unbalanced": _train(folder, out_dir + "/unbalanced", {}, dp_load_balance=False),
           "refit": _train(folder, out_dir + "/refit", {}, dp_balance_refit=True, dp_balance_refit_steps=2),
           "dp1": _train(folder, out_dir + "/dp1", {"tensor_parallel_size": 2})}
    try:
        _train(folder, out_dir + "/mismatch", {}, docs=long_tailed_docs(seed=100 + dist.get_rank()))
        out["mismatch"] = "trained"
    except DataError as err:
        out["mismatch"] = str(err)
    return out


def run_two_ranks(tmp_path_factory, name: str, rank_fn):
    """``rank_fn(checkpoint, out_dir)`` on 2 ranks over a tiny Llama with room for packed rows: (out_dir, per-rank
    results)."""
    from loongforge_hf.parallel.spawn import run_distributed
    from loongforge_hf.testing import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp(name)
    src = make_tiny_checkpoint(tmp / "src", "llama", max_position_embeddings=MAX_POSITIONS)
    return tmp / "out", run_distributed(rank_fn, 2, str(src), str(tmp / "out"), timeout=300)
