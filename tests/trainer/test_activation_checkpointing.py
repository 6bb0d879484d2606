"""LoongTrainer with ``activation_checkpointing=True`` (``gradient_checkpointing`` in older transformers) recomputes
every decoder layer through megatron-core's full recompute and trains exactly as without it (fp32 on CPU: the same
losses and weights within 1e-6), under TP2; unsupported options are refused."""

import dataclasses

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _train(folder: str, out_dir: str, layout: dict):
    import transformers

    import loongforge_hf as lf
    from tests.trainer._train_parity import losses_of, make_dataset, training_args

    field = ("activation_checkpointing" if "activation_checkpointing" in
             {f.name for f in dataclasses.fields(transformers.TrainingArguments)} else "gradient_checkpointing")
    result = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        calls = []
        layer = model.chunks[0].decoder.layers[0]
        layer.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
        trainer = lf.LoongTrainer(model=model, args=training_args(f"{out_dir}/{recompute}", **{field: recompute}),
                                  train_dataset=make_dataset())
        trainer.train()
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        result[recompute] = {"losses": losses_of(trainer.state.log_history), "weights": weights,
                             "forwards": len(calls), "no_grad_forwards": calls.count(False),
                             "flag": model.is_gradient_checkpointing}
        if recompute:
            # compared here: tensors do not travel back through the spawn queue
            result["max_weight_diff"] = max((weights[n] - w).abs().max().item()
                                            for n, w in result[False]["weights"].items())
            result["max_weight"] = max(w.abs().max().item() for w in weights.values())
            refused = []
            for kwargs in ({"every_n_layers": 2}, {"offload": True}, {"activation_checkpointing_kwargs": {"x": 1}}):
                try:
                    model.activation_checkpointing_enable(**kwargs)
                except ValueError as e:
                    refused.append(str(e))
            result["refused"] = refused
        del trainer, model
    for run in (False, True):
        del result[run]["weights"]
    return result


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ac") / "src", "qwen3")


def test_recompute_trains_like_no_recompute_under_tp2(checkpoint, tmp_path):
    results = run_distributed(_train, 2, str(checkpoint), str(tmp_path / "o"), {"tensor_parallel_size": 2},
                              timeout=300)
    for r in results:
        plain, recomputed = r[False], r[True]
        assert not plain["flag"] and recomputed["flag"]
        # 4 optimizer steps x 2 micro-batches: each layer runs once per micro-batch without recompute, and once
        # more (the recomputation, with grad enabled) with it; the first forward then runs under no_grad
        assert plain["forwards"] == 8 and plain["no_grad_forwards"] == 0, plain["forwards"]
        assert recomputed["forwards"] == 16 and recomputed["no_grad_forwards"] == 8, recomputed["forwards"]
        assert recomputed["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
        assert r["max_weight_diff"] <= 1e-6 * r["max_weight"], (r["max_weight_diff"], r["max_weight"])
        assert len(r["refused"]) == 3 and "every_n_layers=2" in r["refused"][0], r["refused"]
