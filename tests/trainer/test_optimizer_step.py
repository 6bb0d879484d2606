"""MegatronEngine's optimizer step folds the gradients' 1/tokens scaling and the clipping into one factor:
inside torch's fused AdamW (its ``grad_scale`` divisor) when the inner optimizers are fused, else one multiply over
the grads. Both routes must give the same training as each other (and, through tests/trainer/test_trainer_parity.py,
as transformers.Trainer), with clipping active, over DP2 with unequal token counts per rank, for both optimizer
precisions."""

import torch

from loongforge_hf.parallel.spawn import run_distributed

MAX_GRAD_NORM = 0.05  # small enough that every step clips (asserted below)


def _batches(vocab: int, rank: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(11 + rank)
    steps = []
    for _ in range(3):
        micro = []
        for _ in range(2):
            ids = torch.randint(4, vocab, (2, 12), generator=g)
            labels = ids.clone()
            labels[:, : 2 + 3 * rank] = -100  # the ranks score different numbers of tokens
            micro.append({"input_ids": ids, "labels": labels})
        steps.append(micro)
    return steps


def _train(folder: str, out_dir: str) -> dict:
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    # NOTE: adam_epsilon 1e-6: with 1e-8 an element whose gradient is near zero gets a step of up to lr whose size
    # follows the rounding of g and of g / (|g| + eps), which the fused kernel (its grad_scale divisor) and foreach do
    # differently (on a 2026-11-28 CI machine 2 embedding elements of 16,384 differed by 1.3e-5 in fp32)
    args = transformers.TrainingArguments(out_dir, use_cpu=True, learning_rate=1e-2, weight_decay=0.1,
                                          adam_epsilon=1e-6, max_grad_norm=MAX_GRAD_NORM, report_to=[])
    checked = {}
    for precision, dtype in (("fp32", torch.float32), ("model", torch.float32), ("model", torch.bfloat16)):
        runs = {}
        for fused in (False, True):
            model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            engine = MegatronEngine(model, args=args, fused_adam=fused, optimizer_precision=precision)
            inner = engine.inner_optimizers()
            assert all(bool(g.get("fused")) is fused for o in inner for g in o.param_groups)
            seen = []
            for o in inner:
                step = o.step

                def spy(*a, _step=step, _o=o, **kw):
                    seen.append(getattr(_o, "grad_scale", None))
                    return _step(*a, **kw)
                o.step = spy
            results = [engine.train_step(b) for b in _batches(model.config.vocab_size, dist.get_rank())]
            assert all(r.grad_norm > MAX_GRAD_NORM for r in results), [r.grad_norm for r in results]
            # fused: the factor went into AdamW as its grad_scale divisor (> 1: 1 / (scale x clip)); else no divisor
            assert all((s is not None and float(s) > 1.0) if fused else s is None for s in seen), seen
            assert all(not hasattr(o, "grad_scale") for o in inner)
            runs[fused] = {"losses": torch.tensor([r.loss for r in results]),
                           "norms": torch.tensor([r.grad_norm for r in results]),
                           "weights": {n: p.detach().float().clone() for n, p in model.named_parameters()}}
        # NOTE: the same update up to the rounding of fused vs foreach AdamW: fp32 state ~1e-6. bf16 weights and
        # moments: the fused kernel computes in fp32 and rounds once, foreach rounds every operation to bf16, so an
        # element whose gradient is near zero can get an Adam step of the other sign (|step| <= lr per step): the
        # weights are compared by their mean difference and bounded by 2 x lr x steps per element.
        off, on = runs[False], runs[True]
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(on["losses"], off["losses"], **tol)
        torch.testing.assert_close(on["norms"], off["norms"], **tol)
        for n in off["weights"]:
            if dtype == torch.float32:
                torch.testing.assert_close(on["weights"][n], off["weights"][n], **tol, msg=lambda m, n=n: f"{n}: {m}")
                continue
            diff = (on["weights"][n] - off["weights"][n]).abs()
            assert diff.mean() < 5e-4 and diff.max() <= 2 * args.learning_rate * 3 + 1e-3, (n, diff.mean(), diff.max())
        checked[f"{precision}/{dtype}"] = off["norms"].tolist()
    return checked


def test_fused_grad_scale_equals_explicit_scaling_dp2(tmp_path):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "src", "llama")
    results = run_distributed(_train, 2, str(folder), str(tmp_path / "out"), timeout=600)
    assert results[0] == results[1]  # every rank reports the same global norms
