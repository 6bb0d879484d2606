"""Rank functions: TrainingArguments that reach the data loading, the process groups and a model's second trainer,
under transformers.Trainer ("hf") and LoongTrainer ("lf")."""

import torch

from ._train_parity import _model_and_trainer, losses_of, make_dataset, training_args


def _rows(trainer) -> list[int]:
    """The rows of each training batch this rank gets."""
    return [len(b["input_ids"]) for b in trainer.get_train_dataloader()]


def accelerator_config_run(kind: str, folder: str, out_dir: str) -> dict:
    """accelerator_config split_batches, even_batches=False (with an evaluation whose last batches differ in rows)
    and use_seedable_sampler=False: each rank's training batch rows and the logged losses; the seedable default for
    comparison."""
    cases = {"default": ({"seed": 5}, 16),
             "split_batches": ({"accelerator_config": {"split_batches": True}}, 16),
             "even_batches_off": ({"accelerator_config": {"even_batches": False}, "dataloader_drop_last": False,
                                   "gradient_accumulation_steps": 1, "max_steps": -1, "num_train_epochs": 1,
                                   "per_device_eval_batch_size": 2}, 7),
             "seedable_off": ({"accelerator_config": {"use_seedable_sampler": False}, "seed": 5}, 16)}
    out = {}
    for name, (args_kw, rows) in cases.items():
        torch.manual_seed(0)
        model, trainer_cls = _model_and_trainer(kind, folder)
        trainer = trainer_cls(model=model, args=training_args(f"{out_dir}/{name}", **args_kw),
                              train_dataset=make_dataset(n=rows), eval_dataset=make_dataset(n=7, seed=11))
        out[name] = {"rows": _rows(trainer), "steps": trainer.train().global_step,
                     "losses": losses_of(trainer.state.log_history)}
        if name == "even_batches_off" and kind == "lf":
            # NOTE: evaluation, 7 rows in batches of 2: rank 0 gets batches [0, 1] and [4, 5], rank 1 [2, 3] and
            # [6], gathered without the repeated first rows even_batches adds. Trainer (its model takes
            # num_items_in_batch) divides each rank's loss by both ranks' label tokens of the step, times 2 ranks,
            # and averages the gathered losses repeated per row: a 1-row batch beside a 2-row one weighs less than
            # its tokens (5.58 here, where one process gives 5.32). transformers.Trainer itself gathers the uneven
            # batches with an all_gather of unequal tensors, which over gloo gave that 5.57 or failed: the reference
            # is computed here from each batch's mean, label tokens and rows.
            out[name]["eval_loss"] = trainer.evaluate()["eval_loss"]
            data = make_dataset(n=7, seed=11)
            model.eval()
            batches = [(i, min(2, 7 - i)) for i in range(0, 7, 2)]
            with torch.no_grad():
                means = [float(model(input_ids=torch.tensor(data["input_ids"][i:i + n]),
                                     labels=torch.tensor(data["labels"][i:i + n])).loss) for i, n in batches]
            tokens = [int((torch.tensor(data["labels"][i:i + n])[:, 1:] != -100).sum()) for i, n in batches]
            losses = [m * c / (tokens[b - b % 2] + tokens[b - b % 2 + 1]) * 2
                      for b, (m, c) in enumerate(zip(means, tokens))]
            out[name]["eval_loss_trainer"] = sum(loss * n for loss, (_, n) in zip(losses, batches)) / 7
    return out


def refused_data_settings(folder: str, out_dir: str) -> dict:
    """{case: the DataError's message} for accelerator_config settings the data-parallel ranks cannot honour."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cases = {"uneven_shards": ({"accelerator_config": {"even_batches": False}, "dataloader_drop_last": False}, 5),
             "uneven_split": ({"accelerator_config": {"even_batches": False, "split_batches": True},
                               "dataloader_drop_last": False}, 5),
             "split_indivisible": ({"accelerator_config": {"split_batches": True},
                                    "per_device_train_batch_size": 3}, 16)}
    out = {}
    for name, (args_kw, rows) in cases.items():
        trainer = lf.LoongTrainer(model=model, args=training_args(f"{out_dir}/{name}", **args_kw),
                                  train_dataset=make_dataset(n=rows))
        try:
            trainer.get_train_dataloader()
            out[name] = None
        except ValueError as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def dataloader_arguments(kind: str, folder: str, out_dir: str) -> dict:
    """The settings of the DataLoader the trainer builds for dataloader_* arguments (not iterated: no workers start),
    and whether a second get_eval_dataloader hands out the first (persistent workers)."""
    import datasets
    import transformers

    def settings(loader) -> dict:
        # NOTE: a balanced loader's own DataLoader reads the samples, and it pins the micro-batches it packs
        pin = getattr(loader, "_pin", loader.pin_memory if not hasattr(loader, "_steps") else None)
        loader = getattr(loader, "_steps", loader)
        context = loader.multiprocessing_context
        return {"prefetch_factor": loader.prefetch_factor, "pin_memory": pin,
                "in_order": loader.in_order, "persistent_workers": loader.persistent_workers,
                "num_workers": loader.num_workers, "context": context.get_start_method() if context else None}

    model, trainer_cls = _model_and_trainer(kind, folder)
    args = training_args(out_dir, dataloader_num_workers=2, dataloader_prefetch_factor=7,
                         dataloader_multiprocessing_context="spawn", dataloader_in_order=False,
                         dataloader_persistent_workers=True)
    args.dataloader_pin_memory = True  # NOTE: use_cpu=True turns it off in TrainingArguments.__post_init__
    trainer = trainer_cls(model=model, args=args, train_dataset=make_dataset(), eval_dataset=make_dataset(n=8))
    # NOTE: a packing collator: LoongTrainer balances its batches over the data-parallel ranks (its own DataLoader)
    balanced = trainer_cls(model=model, args=args,
                           train_dataset=datasets.Dataset.from_dict({"input_ids": make_dataset()["input_ids"]}),
                           data_collator=transformers.DataCollatorWithFlattening())
    eval_loader = trainer.get_eval_dataloader()
    return {"train": settings(trainer.get_train_dataloader()), "eval": settings(eval_loader),
            "packed": settings(balanced.get_train_dataloader()),
            "balanced": type(balanced.get_train_dataloader()).__name__,
            "eval_kept": trainer.get_eval_dataloader() is eval_loader}


def _timeouts() -> dict:
    """Collective timeouts (seconds) of the default group and megatron-core's data-parallel (gloo) group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    return {"default": seconds(dist.group.WORLD), "data_parallel": seconds(ps.get_data_parallel_group()),
            "tensor_parallel": seconds(ps.get_tensor_model_parallel_group())}


def ddp_timeout_run(folder: str, out_dir: str) -> dict:
    """The groups' timeouts after from_pretrained (which starts the default group), then under a LoongTrainer with
    ddp_timeout=7200."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {"loaded": _timeouts()}
    lf.LoongTrainer(model=model, args=training_args(out_dir, ddp_timeout=7200), train_dataset=make_dataset())
    out["trainer"] = _timeouts()
    return out


def short_ddp_timeout_run(folder: str, out_dir: str) -> dict:
    """Under a LoongTrainer with ddp_timeout=1, a data-parallel all-reduce that rank 1 joins 3 s late fails on rank 0
    after about 1 s (gloo honours the timeout set after the group was made). Leaves the world unusable."""
    import datetime
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    in_step = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=5))  # NOTE: not loongforge-hf's
    lf.LoongTrainer(model=model, args=training_args(out_dir, ddp_timeout=1), train_dataset=make_dataset())
    out = {"timeouts": _timeouts()}
    dist.barrier(group=in_step)
    if dist.get_rank() == 1:
        time.sleep(3)
    start, error = time.perf_counter(), None
    try:
        dist.all_reduce(torch.ones(1), group=ps.get_data_parallel_group())
    except RuntimeError as err:
        error = str(err)
    out["waited"], out["error"] = time.perf_counter() - start, error
    return out


def two_trainers_run(kind: str, folder: str, out_dir: str) -> dict:
    """Two trainers in sequence on one model, the second with other data and learning rate, as a user fine-tunes
    twice; LoongTrainer then trains with the first trainer again (its wrapping rebuilt), and reports whether the
    second trainer's gradient buffer is freed once that trainer is dropped."""
    import gc
    import weakref

    torch.manual_seed(0)
    model, trainer_cls = _model_and_trainer(kind, folder)
    first = trainer_cls(model=model, args=training_args(f"{out_dir}/1", max_steps=2), train_dataset=make_dataset())
    first.train()
    second = trainer_cls(model=model, args=training_args(f"{out_dir}/2", max_steps=3, learning_rate=1e-2),
                         train_dataset=make_dataset(seed=9))
    second.train()
    out = {"first": losses_of(first.state.log_history), "second": losses_of(second.state.log_history)}
    buffer = weakref.ref(second.engine.chunks[0].buffers[0]) if kind == "lf" else None
    first.train()  # NOTE: Trainer keeps the first trainer's AdamW state (moments, step count) for this run
    out["first_again"] = losses_of(first.state.log_history)
    probe = torch.tensor(make_dataset(n=2, seed=11)["input_ids"])
    with torch.no_grad():  # NOTE: the weights after the last update (the last logged loss is before it)
        out["final_loss"] = float(model(input_ids=probe.to(model.device), labels=probe.to(model.device)).loss)
    if kind == "lf":
        del second
        gc.collect()
        out["second_buffer_freed"] = buffer() is None
    return out


def both_kinds(fn_name: str, folder: str, out_dir: str) -> dict:
    """``fn_name`` with transformers.Trainer and with LoongTrainer, in one world."""
    fn = globals()[fn_name]
    return {kind: fn(kind, folder, f"{out_dir}/{kind}") for kind in ("hf", "lf")}


def data_parallel_cases(folder: str, out_dir: str) -> dict:
    """Everything the DP2 world checks, in one world: ddp_timeout first (from_pretrained starts the default group),
    then accelerator_config, refusals, DataLoader arguments, two trainers on one model, and the short timeout last
    (its timed-out collective leaves the world unusable)."""
    return {"ddp_timeout": ddp_timeout_run(folder, f"{out_dir}/timeout"),
            "accelerator_config": both_kinds("accelerator_config_run", folder, f"{out_dir}/acc"),
            "refused": refused_data_settings(folder, f"{out_dir}/refused"),
            "dataloader": both_kinds("dataloader_arguments", folder, f"{out_dir}/dl"),
            "two_trainers": both_kinds("two_trainers_run", folder, f"{out_dir}/two"),
            "short_timeout": short_ddp_timeout_run(folder, f"{out_dir}/short")}
