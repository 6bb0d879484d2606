"""What each CPU rank runs in test_fused_loss.py (module-level so that spawned processes can import it).

Each layout loads the same tiny checkpoint twice and compares the fused linear cross-entropy path (the default) with the
materialised-logits path on this rank: the loss of ``forward(labels=..., return_logits=False)`` and its parameter
gradients (pipeline size 1), then one ``MegatronEngine`` step (loss, gradient norm and the updated weights) with label
smoothing 0.3 (TrainingArguments.label_smoothing_factor: the fused kernel's smoothing against the materialised logits'
``kernels.cross_entropy.smoothing_term``, vocab-parallel under TP); the fused run also switches megatron's AdamW to
torch's fused implementation (``fused_adam=True``; CPU has one too), the materialised run keeps megatron's foreach
AdamW. fp32 throughout: only summation order differs, hence 1e-5 (weights after one Adam step of lr 1e-3: Adam
normalises the gradient, so 1e-5 is 1% of a step even for gradients near zero).
"""

import torch

ATOL = RTOL = 1e-5
LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
           "tp2": {"tensor_parallel_size": 2},
           "pp2": {"pipeline_parallel_size": 2},
           "dp2": {}}
# NOTE: the LM head's weight frozen (its bias, where it has one, still trained)
FROZEN_HEAD_WEIGHT = "_frozen_head_weight"


def _batches(vocab: int, n: int, rank_seed: int):
    g = torch.Generator().manual_seed(rank_seed)
    out = []
    for _ in range(n):
        ids = torch.randint(4, vocab, (2, 12), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100       # ignored tokens (a prompt) and a row with none ignored
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return out


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def fused_matches_materialised(folder: str, out_dir: str, layouts: list[str]) -> dict:
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf
    import loongforge_hf.bridges.runtime as runtime
    import loongforge_hf.trainer.engine as engine_module
    from loongforge_hf.trainer.engine import MegatronEngine

    materialised = runtime.token_losses

    def refuse(*a, **k):
        raise AssertionError("the fused path computed a loss on materialised logits")

    args = transformers.TrainingArguments(out_dir, use_cpu=True, learning_rate=1e-3, weight_decay=0.0,
                                          max_grad_norm=1.0, report_to=[])
    checked = {}
    for name in layouts:
        layout = LAYOUTS[name.removesuffix(FROZEN_HEAD_WEIGHT)]
        dp = "dp" in name
        results = {}
        for fused in (True, False):
            runtime.token_losses = engine_module.token_losses = refuse if fused else materialised
            model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
            if name.endswith(FROZEN_HEAD_WEIGHT):
                for n, p in model.named_parameters():
                    p.requires_grad_(not n.endswith("output_layer.weight"))
            batches = _batches(model.config.vocab_size, 2, dist.get_rank() if dp else 0)
            res = {}
            if model.parallel.pipeline_parallel_size == 1:
                b = batches[0]
                out = model(**b, return_logits=not fused)
                assert (out.logits is None) == fused
                out.loss.backward()
                res["loss"] = out.loss.detach()
                res["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                model.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    res["loss"] = model(**batches[0], return_logits=not fused).loss
            engine = MegatronEngine(model, args=args, fused_loss=fused, fused_adam=fused)
            engine.label_smoothing = 0.3
            inner = engine.inner_optimizers()
            assert inner and all(bool(g["fused"]) is fused for o in inner for g in o.param_groups), name
            step = engine.train_step(batches)
            res["step"] = (step.loss, step.grad_norm, step.num_tokens)
            res["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            results[fused] = res
        runtime.token_losses = engine_module.token_losses = materialised
        on, off = results[True], results[False]
        _close(on["loss"], off["loss"], f"{name} forward loss")
        if "grads" in on:
            assert sorted(on["grads"]) == sorted(off["grads"]) and on["grads"], name
            assert any(n.endswith("output_layer.bias") for n in on["grads"]) == model.bridge.lm_head_bias, name
            if name.endswith(FROZEN_HEAD_WEIGHT):
                assert not any(n.endswith("output_layer.weight") for n in on["grads"]), name
            for n in on["grads"]:
                _close(on["grads"][n], off["grads"][n], f"{name} grad {n}")
        assert on["step"][2] == off["step"][2], name
        _close(torch.tensor(on["step"][:2]), torch.tensor(off["step"][:2]), f"{name} step loss/grad norm")
        for n in on["weights"]:
            _close(on["weights"][n], off["weights"][n], f"{name} weight {n}")
        checked[name] = float(on["loss"])
    return checked
