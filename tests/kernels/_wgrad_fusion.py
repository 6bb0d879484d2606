"""What each CPU rank runs in test_wgrad_fusion.py (module-level so that spawned processes can import it).

Per layout the same tiny checkpoint is loaded twice and one ``MegatronEngine`` step of two micro-batches runs with
megatron's gradient-accumulation fusion on (``fused_wgrad=True``: weight grads added into DDP's fp32 ``main_grad`` by
``xpu.common.TorchWgradAccumulation``) and off (autograd's weight grad, then DDP's ``main_grad.add_``). fp32 weights:
only the order of additions differs (one ``addmm`` vs. a GEMM then an add), hence 1e-5 on the accumulated main
grads, the step's loss and grad norm and the updated weights.
"""

import torch

ATOL = RTOL = 1e-5
LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}, "dp2": {}}


def _batches(vocab: int, rank_seed: int):
    g = torch.Generator().manual_seed(rank_seed)
    out = []
    for _ in range(2):
        ids = torch.randint(4, vocab, (2, 12), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return out


def fused_wgrad_matches_unfused(folder: str, out_dir: str, layouts: list[str]) -> dict:
    import torch.distributed as dist
    import transformers
    from megatron.core.tensor_parallel import layers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine
    from loongforge_hf.xpu import common

    calls = []
    accumulate = common._accumulate_wgrad

    def counting(input, grad_output, main_grad):
        calls.append(tuple(main_grad.shape))
        return accumulate(input, grad_output, main_grad)

    common._accumulate_wgrad = counting
    args = transformers.TrainingArguments(out_dir, use_cpu=True, learning_rate=1e-3, weight_decay=0.0,
                                          max_grad_norm=1.0, report_to=[])
    checked = {}
    for name in layouts:
        results = {}
        for fused in (True, False):
            model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **LAYOUTS[name])
            batches = _batches(model.config.vocab_size, dist.get_rank() if name.startswith("dp") else 0)
            linears = [m for chunk in model.megatron.chunks for m in chunk.modules()
                       if isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear))
                       and m.weight is not None]
            engine = MegatronEngine(model, args=args, fused_wgrad=fused)
            assert engine.fused_wgrad_layers == (len(linears) if fused else 0), (name, engine.fused_wgrad_layers)
            assert all(m.gradient_accumulation_fusion is fused for m in linears), name
            calls.clear()
            step = engine.train_step(batches)
            # NOTE: every linear, once per micro-batch, went through the fused accumulation (and none when off).
            assert len(calls) == (2 * len(linears) if fused else 0), (name, len(calls))
            results[fused] = {
                "step": torch.tensor([step.loss, step.grad_norm]),
                "main_grads": {n: p.main_grad.clone() for n, p in model.named_parameters() if hasattr(p, "main_grad")},
                "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
        on, off = results[True], results[False]
        torch.testing.assert_close(on["step"], off["step"], atol=ATOL, rtol=RTOL)
        assert sorted(on["main_grads"]) == sorted(off["main_grads"]) and on["main_grads"], name
        for kind in ("main_grads", "weights"):
            for n in on[kind]:
                torch.testing.assert_close(on[kind][n], off[kind][n], atol=ATOL, rtol=RTOL,
                                           msg=lambda m, n=n, kind=kind: f"{name} {kind} {n}: {m}")
        checked[name] = float(on["step"][0])
    common._accumulate_wgrad = accumulate
    return checked
