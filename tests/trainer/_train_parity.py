"""Rank functions: train the same tiny model with transformers.Trainer and with LoongTrainer."""

import torch


def make_dataset(n: int = 16, seq: int = 16, vocab: int = 203, seed: int = 3, ragged: bool = False):
    """``n`` random rows whose first 2 labels are ignored (a prompt); ``ragged``: row i ignores its first
    2 + i % 7 (batches, and data-parallel ranks, then hold different numbers of label tokens)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, seq), generator=g)
    labels = ids.clone()
    for i in range(n):
        labels[i, :2 + (i % 7 if ragged else 0)] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def training_args(out_dir: str, **overrides):
    import transformers

    kw = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
              learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5,
              logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
              dataloader_drop_last=True)
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def losses_of(log_history):
    return [h["loss"] for h in log_history if "loss" in h]


def train_hf(folder: str, out_dir: str, args_kw: dict | None = None, data_kw: dict | None = None):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = transformers.Trainer(model=model, args=training_args(out_dir, **(args_kw or {})),
                                   train_dataset=make_dataset(**(data_kw or {})),
                                   eval_dataset=make_dataset(n=8, seed=11, **(data_kw or {})))
    trainer.train()
    trainer.save_model(out_dir + "/final")
    # NOTE: under DP2 each process holds 4 of the 8 eval rows, fewer than one eval batch (8) with dataloader_drop_last:
    # no batch is evaluated and there is no eval_loss (LoongTrainer alike); the DP2 comparison skips eval then.
    return losses_of(trainer.state.log_history) + [trainer.evaluate().get("eval_loss")]


def train_loong(folder: str, out_dir: str, layout: dict, args_kw: dict | None = None, data_kw: dict | None = None):
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    trainer = lf.LoongTrainer(model=model, args=training_args(out_dir, **(args_kw or {})),
                              train_dataset=make_dataset(**(data_kw or {})),
                              eval_dataset=make_dataset(n=8, seed=11, **(data_kw or {})))
    out = trainer.train()
    trainer.save_model(out_dir + "/final")
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses_of(trainer.state.log_history) + [trainer.evaluate().get("eval_loss")],
            "global_step": out.global_step,
            "keys": sorted(logs[0]) if logs else [], "train_loss": out.training_loss}


def with_and_without(tmp, setting: dict, data_kw: dict):
    """A tiny Llama under ``tmp`` and two one-process transformers.Trainer runs on it, without and with the
    TrainingArguments ``setting``: (checkpoint, plain losses, losses with it, the folder its trained model is in)."""
    from loongforge_hf.parallel.spawn import run_distributed
    from loongforge_hf.testing import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp / "src", "llama")
    plain = run_distributed(train_hf, 1, str(src), str(tmp / "plain"), None, data_kw, timeout=300)[0]
    changed = run_distributed(train_hf, 1, str(src), str(tmp / "hf"), setting, data_kw, timeout=300)[0]
    return src, plain, changed, tmp / "hf" / "final"


def stop_after_callback(stop_after: int | None):
    """A callback that ends training and saves a checkpoint after step ``stop_after`` (a killed run); None: never."""
    import transformers

    class StopAfter(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if stop_after is not None and state.global_step >= stop_after:
                control.should_training_stop = True
                control.should_save = True
            return control

    return StopAfter()


def train_loong_resumable(folder: str, out_dir: str, layout: dict, *, stop_after: int | None = None,
                          resume: str | None = None, max_steps: int = 6, rows: int = 24, args_kw: dict | None = None):
    """Train with checkpoints every 3 steps; optionally stop early (a killed run) or resume from a checkpoint."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    args = training_args(out_dir, max_steps=max_steps, save_strategy="steps", save_steps=3, save_total_limit=2,
                         gradient_accumulation_steps=1, per_device_train_batch_size=2, **(args_kw or {}))
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=make_dataset(n=rows),
                              callbacks=[stop_after_callback(stop_after)])
    trainer.train(resume_from_checkpoint=resume)
    steps = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    trainer.save_model()  # Trainer's default: the HF export lands in output_dir, beside the checkpoints
    return steps


def _model_and_trainer(kind: str, folder: str):
    """(model, trainer class): transformers' ("hf") or loongforge's ("lf"), fp32."""
    import transformers

    import loongforge_hf as lf

    if kind == "hf":
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), transformers.Trainer
    return lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), lf.LoongTrainer


def best_model_run(kind: str, folder: str, out_dir: str) -> dict:
    """load_best_model_at_end with one checkpoint kept: the best (step 1 at this learning rate) must survive the
    rotation and be the trained model's weights at the end."""
    import os

    torch.manual_seed(0)
    args = training_args(out_dir, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                         save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                         learning_rate=5e-2, max_steps=3)
    model, trainer_cls = _model_and_trainer(kind, folder)
    trainer = trainer_cls(model=model, args=args, train_dataset=make_dataset(n=32),
                          eval_dataset=make_dataset(n=8, seed=11))
    trainer.train()
    trainer.save_model(out_dir + "/final")
    return {"evals": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
            "best_step": trainer.state.best_global_step,
            "best": os.path.basename(trainer.state.best_model_checkpoint or ""),
            "eval_after": trainer.evaluate()["eval_loss"],
            "kept": sorted(p for p in os.listdir(out_dir) if p.startswith("checkpoint"))}


def refused_arguments(folder: str, out_dir: str) -> dict:
    """{case: the ValueError's message or None} for TrainingArguments / Trainer arguments LoongTrainer cannot honour."""
    import transformers

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    class CustomLoss(lf.LoongTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            raise AssertionError("never called")

    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = {"optim": ({"optim": "sgd"}, {}),
             "optimizers": ({}, {"optimizers": (sgd, transformers.get_constant_schedule(sgd))}),
             "compute_loss_func": ({}, {"compute_loss_func": lambda *a, **k: 0}),
             "compute_loss": ({}, {"trainer_cls": CustomLoss}),
             "reduce_lr_on_plateau": ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"},
                                      {"eval_dataset": make_dataset(n=8, seed=11)}),
             "batch_rebalance": ({"train_sampling_strategy": "batch_rebalance"}, {}),
             "use_liger_kernel": ({"use_liger_kernel": True}, {}),
             "bf16_full_eval": ({"bf16_full_eval": True}, {}),  # NOTE: evaluate() would cast the fp32 model
             "accepted": ({"optim": "adamw_torch_fused"}, {})}
    out = {}
    for name, (args_kw, trainer_kw) in cases.items():
        trainer_cls = trainer_kw.pop("trainer_cls", lf.LoongTrainer)
        try:
            trainer_cls(model=model, args=training_args(out_dir, **args_kw), train_dataset=make_dataset(), **trainer_kw)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def warnings_and_cache_clears(folder: str, out_dir: str) -> dict:
    """What LoongTrainer warns about bf16=True / torch_compile=True on a float32 model, and how often it empties the
    device cache with torch_empty_cache_steps=1 over 2 steps."""
    import logging

    import loongforge_hf as lf
    import loongforge_hf.trainer.loong_trainer as loong_trainer

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger(loong_trainer.__name__).addHandler(handler)
    clears = []
    loong_trainer.clear_device_cache = lambda: clears.append(1)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = lf.LoongTrainer(model=model, args=training_args(out_dir, max_steps=2, bf16=True, torch_compile=True,
                                                              torch_empty_cache_steps=1),
                              train_dataset=make_dataset())
    trainer.train()
    return {"warnings": records, "clears": len(clears)}


def dropout_seed_losses(folder: str, out_dir: str, seed: int) -> dict:
    """Logged losses of a model with attention dropout under TrainingArguments(seed=seed) (data order fixed), and
    the step callback events in the order they fired."""
    import loongforge_hf as lf

    events = []
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = lf.LoongTrainer(model=model, args=training_args(out_dir, seed=seed, data_seed=5, max_steps=2),
                              train_dataset=make_dataset(), callbacks=[_event_recorder(events)])
    trainer.train()
    return {"losses": losses_of(trainer.state.log_history), "events": events}


def _event_recorder(events: list):
    """A callback appending (event, global_step) for each step event Trainer fires."""
    import transformers

    class Events(transformers.TrainerCallback):
        pass

    for name in ("on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"):
        setattr(Events, name, lambda self, args, state, control, _name=name, **kw: events.append(
            (_name, state.global_step)))
    return Events()


def trainer_events(folder: str, out_dir: str) -> list:
    """The step events transformers.Trainer fires on the HF model, with dropout_seed_losses' arguments."""
    import transformers

    events = []
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = transformers.Trainer(model=model, args=training_args(out_dir, seed=0, data_seed=5, max_steps=2),
                                   train_dataset=make_dataset(), callbacks=[_event_recorder(events)])
    trainer.train()
    return events


def logging_run(kind: str, folder: str, out_dir: str) -> dict:
    """What Trainer logs beyond the loss: tokens seen without padding, the epoch fraction of an epoch whose last
    accumulation window is partial (7 micro-batches, accumulation 2), grad_norm without clipping, total_flos."""
    import datasets

    torch.manual_seed(0)
    rows = make_dataset(n=14)
    masks = [[1] * 16 if i % 2 == 0 else [1] * 13 + [0] * 3 for i in range(14)]
    labels = [[t if m else -100 for t, m in zip(r, mask)] for r, mask in zip(rows["labels"], masks)]
    data = datasets.Dataset.from_dict({"input_ids": rows["input_ids"], "attention_mask": masks, "labels": labels})
    args = training_args(out_dir, max_steps=-1, num_train_epochs=2, max_grad_norm=0.0,
                         include_num_input_tokens_seen="non_padding")
    model, trainer_cls = _model_and_trainer(kind, folder)
    trainer = trainer_cls(model=model, args=args, train_dataset=data)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h.get(key) for h in logs] for key in ("loss", "grad_norm", "epoch", "num_input_tokens_seen")} | \
        {"total_flos": trainer.state.total_flos}


def both(fn_name: str, folder: str, out_dir: str) -> dict:
    """``fn_name`` (best_model_run, logging_run or packed_tokens_run) with transformers.Trainer and LoongTrainer."""
    fn = globals()[fn_name]
    return {kind: fn(kind, folder, f"{out_dir}/{kind}") for kind in ("hf", "lf")}


def dropout_seed_runs(folder: str, out_dir: str, seeds: list) -> dict:
    return {"runs": [dropout_seed_losses(folder, f"{out_dir}/s{i}", seed) for i, seed in enumerate(seeds)],
            "trainer_events": trainer_events(folder, f"{out_dir}/hf")}


def eval_predict_run(kind: str, folder: str, out_dir: str, layout: dict | None = None) -> dict:
    """evaluate() with compute_metrics fed logits, labels, inputs and losses, and predict() with and without labels:
    7 rows in batches of 3 (a last batch of one row). What compute_metrics saw and what predict returned, as numpy."""
    import numpy as np
    import transformers

    import loongforge_hf as lf

    seen = {}

    def compute_metrics(p):
        seen.update(predictions=p.predictions, label_ids=p.label_ids, inputs=p.inputs, losses=p.losses)
        hits = (p.predictions[:, :-1].argmax(-1) == p.label_ids[:, 1:])[p.label_ids[:, 1:] != -100]
        return {"accuracy": float(hits.mean()), "rows": int(p.label_ids.shape[0])}

    torch.manual_seed(0)
    if kind == "hf":
        model, trainer_cls = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), \
            transformers.Trainer
    else:
        model, trainer_cls = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **(layout or {})), \
            lf.LoongTrainer
    args = training_args(out_dir, per_device_eval_batch_size=3, include_for_metrics=["inputs", "loss"],
                         eval_accumulation_steps=2, dataloader_drop_last=False)
    trainer = trainer_cls(model=model, args=args, eval_dataset=make_dataset(n=7, seed=11),
                          compute_metrics=compute_metrics)
    timing = ("runtime", "per_second", "preparation_time")

    def untimed(found: dict, prefix: str) -> dict:
        """The metrics without timings, plus the loop's step count (steps per second x runtime)."""
        steps = round(found[f"{prefix}_steps_per_second"] * found[f"{prefix}_runtime"])
        return {**{k: v for k, v in found.items() if not any(t in k for t in timing)}, f"{prefix}_loop_steps": steps}

    metrics = untimed(trainer.evaluate(), "eval")
    metrics["logged_loop_steps"] = untimed(trainer.state.log_history[-1], "eval")["eval_loop_steps"]
    pred = trainer.predict(make_dataset(n=7, seed=4))
    unlabelled = trainer.predict(make_dataset(n=5, seed=4).remove_columns("labels"))
    return {"metrics": metrics, "seen": {k: np.asarray(v) for k, v in seen.items()},
            "predictions": pred.predictions, "label_ids": pred.label_ids,
            "test_metrics": untimed(pred.metrics, "test"),
            "unlabelled": unlabelled.predictions}


def packed_tokens_run(kind: str, folder: str, out_dir: str) -> dict:
    """Padding-free packing (DataCollatorWithFlattening) of rows of different lengths with
    include_num_input_tokens_seen="all": the data-parallel ranks' packed rows differ in length."""
    import datasets
    import transformers

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(4, 203, (int(torch.randint(6, 17, (1,), generator=g)),), generator=g).tolist()
            for _ in range(20)]
    args = training_args(out_dir, max_steps=-1, num_train_epochs=1, include_num_input_tokens_seen="all")
    model, trainer_cls = _model_and_trainer(kind, folder)
    trainer = trainer_cls(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
                          data_collator=transformers.DataCollatorWithFlattening())
    trainer.train()
    return {"loss": losses_of(trainer.state.log_history), "tokens": trainer.state.num_input_tokens_seen}


def resume_runs(folder: str, out_dir: str, rows: int, args_kw: dict) -> dict:
    """{uninterrupted, resumed}: step -> loss of 6 steps, and of a run killed after step 3 and resumed."""
    full = train_loong_resumable(folder, out_dir + "/full", {}, rows=rows, args_kw=args_kw)
    train_loong_resumable(folder, out_dir + "/run", {}, stop_after=3, rows=rows, args_kw=args_kw)
    resumed = train_loong_resumable(folder, out_dir + "/run", {}, resume=out_dir + "/run/checkpoint-3", rows=rows,
                                    args_kw=args_kw)
    return {"uninterrupted": dict(full), "resumed": dict(resumed)}


def streamed_losses(folder: str, out_dir: str, loong: bool, layout: dict | None = None) -> list:
    """4 steps on a ``datasets.IterableDataset`` (``to_iterable_dataset()`` of 32 ragged rows) with
    transformers.Trainer or LoongTrainer (in ``layout``): the logged losses."""
    import transformers

    import loongforge_hf as lf

    dataset = make_dataset(n=32, ragged=True).to_iterable_dataset()
    args = training_args(out_dir)
    if loong:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **(layout or {}))
        trainer = lf.LoongTrainer(model=model, args=args, train_dataset=dataset)
    else:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    return losses_of(trainer.state.log_history)
