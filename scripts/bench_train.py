"""Single-device training speed, side by side: transformers (sdpa), transformers + Liger-Kernel, loongforge-hf.

Workloads (random init, bf16 weights, random tokens, one optimizer step per micro-batch):
  a  Qwen3-0.6B shape: 28 layers, hidden 1024, intermediate 3072, 16 heads, 8 KV heads, head_dim 128, vocab 151936,
     tied embeddings; seq 4096, micro-batch 4
  b  Llama-3-8B shape cut to 8 layers (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256, untied);
     seq 8192, micro-batch 1
  c  Qwen3-30B-A3B shape cut to 4 layers (hidden 2048, 32 heads, 4 KV heads, head_dim 128, 128 experts, top-8,
     moe_intermediate 768, vocab 151936, untied); seq 4096, micro-batch 2
  d  gpt-oss-20b shape cut to 2 layers, one sliding (128-token window) and one full (hidden 2880, 64 heads of 64,
     8 KV heads, sinks, 32 experts of 2880 with biases, top-4, YaRN, vocab 201088, untied); seq 4096, micro-batch 2.
     transformers runs gpt-oss's eager attention (its only one with sinks without a hub kernel); no Liger row.
  e  Pythia-1.4B shape (24 layers, hidden 2048, 16 heads, intermediate 8192, vocab 50304, untied; the attention and
     the MLP side by side, LayerNorms and biases, partial rotary 0.25, GELU); seq 2048, micro-batch 8. No Liger row
     (Liger-Kernel has no GPT-NeoX patch).
  f  Gemma-2-2B shape (26 layers, soft-capped attention and logits, a 4096-token window on every other layer, GeGLU,
     vocab 256000, tied); seq 4096, micro-batch 2. transformers runs Gemma 2's eager attention (its cap).
  g  Qwen3.5-style dense shape (our sizes: 24 layers, 18 Gated DeltaNet (16 key / 32 value heads of 128) and 6 gated
     full attentions (16 heads, 2 KV heads of 256, partial rotary 0.25), hidden 2048, intermediate 6144, vocab 248320,
     tied); seq 4096, micro-batch 2. Liger without rope (its Qwen3.5 patch has none); no fla package for any row.

Each workload's checkpoint is written once by transformers (``from_config`` + ``save_pretrained``, bf16, seed 0) and
every stack loads it from that folder: transformers with ``from_pretrained``, Liger after
``apply_liger_kernel_to_<model>`` (rope, RMSNorm, SwiGLU and fused linear cross-entropy on), loongforge-hf through
its bridge (``AutoModelForCausalLM.from_pretrained(tensor_parallel_size=1, dtype=bf16)``) and ``MegatronEngine``.
Each stack trains in its own process on the same device, on the same token batches.

One training step, every stack: forward with labels (mean loss over tokens), backward, gradient clipping at 1.0,
AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay), gradients cleared. transformers' stacks: bf16 weights,
torch's fused AdamW on them. loongforge-hf: megatron's DDP and distributed optimizer as ``MegatronEngine`` builds them
(fp32 main weights, gradients and moments; torch AdamW, switched to its fused implementation on CUDA by the engine),
the loss through the fused linear cross-entropy (no full logits), and the kernels' Triton paths (RMSNorm incl. q/k
norm, RoPE, SwiGLU, the cross-entropy chunk) where Triton is importable; the row records which were used.
``--optimizer-precision fp32,model`` adds a row "loongforge-hf optimizer=model":
``MegatronEngine(optimizer_precision="model")``, bf16 grad buffer, weights and AdamW moments (torch AdamW over the
bf16 parameters, as in the transformers rows).

MFU counts model FLOPs (``loongforge_hf.trainer.flops.model_flops_per_token``), per token:
  3 * (L * (2*h*(q + 2*kv) + 2*q*h + 6*h*f*k + 2*q*s) + 2*h*V)
with q = heads*head_dim, kv = kv_heads*head_dim, f the (expert) MLP width, k the active experts (1 when dense; 6*h*f
is 4*h*f for an ungated MLP, workload e), s the sequence, V the vocabulary: 6 * (active matmul parameters) per
token plus causal attention 12*L*q*s/2, against a peak of --peak-tflops (989 for H100/H200 dense bf16).

A stack that runs out of memory at the workload's micro-batch is measured again at micro-batch 1 with gradient
accumulation over as many micro-batches (same tokens per optimizer step), and both facts are reported.
``--accum N`` runs every stack with N micro-batches of the workload's size per optimizer step (N times the tokens).

    python scripts/bench_train.py [--shapes a,b,c] [--stacks transformers,liger,loongforge] [--steps 10]
                                  [--warmup 3] [--profile a,c] [--out outputs/bench_train.json]
                                  [--fp8 on,adaptive] [--optimizer-precision fp32,model]
    python scripts/bench_train.py --tiny --device cpu --stacks transformers,loongforge     # a dry run
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402

STACKS = ("transformers", "liger", "loongforge")
# options of a loongforge row ("loongforge optimizer=model graphs=local"): the worker flag each sets, and its values
VARIANT_OPTIONS = {"fp8": ("--fp8", ("on", "adaptive")),
                   "recipe": ("--fp8-recipe", ("blockwise", "blockwise_wgrad2d", "rowwise", "te_delayed",
                                               "te_tensorwise", "te_blockwise", "te_mxfp8")),
                   "optimizer": ("--optimizer-precision", ("fp32", "model")),
                   "graphs": ("--cuda-graphs", ("local",)), "adam": ("--adam", ("torch", "triton")),
                   "stats": ("--token-stats", ("on",))}
STACK_TITLES = {"transformers": "transformers (sdpa)", "liger": "transformers + Liger-Kernel",
                "loongforge": "loongforge-hf (TP=1, MegatronEngine)"}
LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-4, (0.9, 0.999), 1e-8, 0.0, 1.0
SEED = 0


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    model_type: str
    config: dict
    seq: int
    micro_batch: int
    tiny: dict = field(default_factory=dict)   # what --tiny changes (same code paths, small sizes)


_TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, max_position_embeddings=256)

WORKLOADS = {
    "a": Workload("a", "Qwen3-0.6B shape, seq 4096, micro-batch 4", "qwen3",
                  dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  seq=4096, micro_batch=4, tiny=dict(_TINY, seq=64, micro_batch=2)),
    "b": Workload("b", "Llama-3-8B shape cut to 8 layers, seq 8192, micro-batch 1", "llama",
                  dict(num_hidden_layers=8, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
                  seq=8192, micro_batch=1, tiny=dict(_TINY, bos_token_id=1, eos_token_id=2, seq=128, micro_batch=1)),
    "c": Workload("c", "Qwen3-30B-A3B shape cut to 4 layers, seq 4096, micro-batch 2", "qwen3_moe",
                  dict(num_hidden_layers=4, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                       moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                       vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  seq=4096, micro_batch=2, tiny=dict(_TINY, num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, seq=64, micro_batch=2)),
    # NOTE: gpt-oss-20b's layer shape (sinks, a 128-token window on the sliding layer, 32 experts with biases and
    # the clamped GLU, YaRN) on two layers, one of each kind
    "d": Workload("d", "gpt-oss-20b shape cut to 2 layers (sliding + full), seq 4096, micro-batch 2", "gpt_oss",
                  dict(num_hidden_layers=2, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                       vocab_size=201088, tie_word_embeddings=False, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, sliding_window=128, layer_types=["sliding_attention", "full_attention"],
                       swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                          "original_max_position_embeddings": 4096}),
                  seq=4096, micro_batch=2,
                  tiny=dict(_TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, seq=64,
                            micro_batch=2)),
    # NOTE: Pythia-1.4B whole: the attention and the MLP side by side, LayerNorms and biases, a quarter of each head
    # rotated, an ungated GELU MLP; no Liger row (Liger-Kernel has no GPT-NeoX patch)
    "e": Workload("e", "Pythia-1.4B shape, seq 2048, micro-batch 8", "gpt_neox",
                  dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                       vocab_size=50304, tie_word_embeddings=False, max_position_embeddings=2048,
                       layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.25}),
                  seq=2048, micro_batch=8,
                  tiny={k: v for k, v in dict(_TINY, seq=64, micro_batch=2).items()
                        if k not in ("num_key_value_heads", "head_dim")}),
    # NOTE: Gemma-2-2B whole: soft-capped attention scores (transformers runs them in its eager attention only: SDPA
    # has no cap, and the flash-attn package is not on the GPU machine) and logits, a 4096-token window on every
    # other layer, GeGLU, post norms, a 256k tied vocabulary
    "f": Workload("f", "Gemma-2-2B shape, seq 4096, micro-batch 2", "gemma2",
                  dict(num_hidden_layers=26, hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
                       max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                  seq=4096, micro_batch=2, tiny=dict(_TINY, sliding_window=24, query_pre_attn_scalar=16, seq=64,
                                                     micro_batch=2)),
    # NOTE: a Qwen3.5-style dense text model (our choice of sizes: Qwen3-Next's layer widths on a dense MLP):
    # three Gated DeltaNet layers to one gated full attention, partial rotary 0.25, zero-centred norms, the
    # Qwen3.5 vocabulary, tied. transformers runs its torch delta rule (the fla package is not installed for this
    # row: fla refuses its gated backward on Hopper with the GPU machine's Triton); Liger has no rope for it
    "g": Workload("g", "Qwen3.5-style dense shape (hidden 2048, 24 layers, 18 Gated DeltaNet), seq 4096, "
                  "micro-batch 2", "qwen3_5_text",
                  dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
                       vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25}),
                  seq=4096, micro_batch=2,
                  tiny=dict(_TINY, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16,
                            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                            seq=100, micro_batch=2)),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "gpt_neox": "GPTNeoXForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM"}
# NOTE: transformers' attention per model type: gpt-oss's sinks and Gemma 2's soft-cap are in its eager attention
# only (their flash kernels come from the hub or the flash-attn package, which the GPU machine does not have)
HF_ATTENTION = {"gpt_oss": "eager", "gemma2": "eager"}
NO_LIGER_ROPE = ("qwen3_5_text",)  # NOTE: Liger-Kernel 0.8.5's Qwen3.5 patch has no rope (hybrid attention)


def sizes(w: Workload, tiny: bool) -> tuple[dict, int, int]:
    """(HF config kwargs, seq, micro-batch) of a workload, shrunk with ``tiny``."""
    if not tiny:
        return dict(w.config), w.seq, w.micro_batch
    small = dict(w.tiny)
    seq, mb = small.pop("seq"), small.pop("micro_batch")
    return {**w.config, **small}, seq, mb


def hf_config(w: Workload, tiny: bool):
    import transformers

    kwargs, _, _ = sizes(w, tiny)
    return transformers.AutoConfig.for_model(w.model_type, **kwargs)


# ---- worker side: the checkpoint and the three stacks ----------------------------------------------------------

def write_checkpoint(w: Workload, *, tiny: bool, folder: Path, device: H.Device) -> dict:
    import torch
    import transformers

    cfg = hf_config(w, tiny)
    torch.manual_seed(SEED)
    with device.device:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    os.replace(partial, folder)
    return {"parameters": sum(p.numel() for p in model.parameters()), "folder": str(folder)}


def build_transformers(folder: str, device: H.Device, *, liger: bool, adapt=None, autocast: bool = False):
    """(step, info) of a transformers stack; ``adapt(model) -> model`` runs before the optimizer is built (it sees
    the parameters that still require grad: bench_lora.py's adapters). ``autocast``: the forward under bf16
    autocast, as transformers.Trainer / TRL run it with ``bf16=True`` (it matters for parameters kept in fp32, such
    as PEFT's adapters)."""
    import contextlib

    import torch
    import transformers

    info = {}
    if liger:
        import liger_kernel.transformers as lk

        apply = {"qwen3": lk.apply_liger_kernel_to_qwen3, "llama": lk.apply_liger_kernel_to_llama,
                 "qwen3_moe": lk.apply_liger_kernel_to_qwen3_moe, "gemma2": lk.apply_liger_kernel_to_gemma2,
                 "qwen3_5_text": lk.apply_liger_kernel_to_qwen3_5}
        model_type = transformers.AutoConfig.from_pretrained(folder).model_type
        if model_type not in apply:
            raise SystemExit(f"Liger-Kernel has no apply_liger_kernel_to_{model_type} here")
        mlp = "geglu" if model_type == "gemma2" else "swiglu"
        rope = model_type not in NO_LIGER_ROPE
        apply[model_type](rope=rope, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=True, **{mlp: True})
        info["liger"] = (f"apply_liger_kernel_to_{model_type}({'rope, ' if rope else ''}rms_norm, {mlp}, "
                         "fused_linear_cross_entropy)")
    model_type = transformers.AutoConfig.from_pretrained(folder).model_type
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                              attn_implementation=HF_ATTENTION.get(model_type, "sdpa"),
                                                              device_map=str(device.device))
    if adapt is not None:
        model = adapt(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=device.is_cuda)
    info.update(attn_implementation=model.config._attn_implementation, optimizer=f"torch AdamW fused={device.is_cuda}",
                autocast="bf16" if autocast else None,
                experts_implementation=getattr(model.config, "_experts_implementation", None),
                parameters=sum(p.numel() for p in params))

    def step(micro_batches):
        total = 0.0
        for ids in micro_batches:
            with torch.autocast(device.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            (loss / len(micro_batches)).backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(micro_batches)

    return step, info


def _triton_on(device) -> bool:
    import torch

    from loongforge_hf.kernels._triton import use_triton

    return use_triton(torch.empty(0, device=device))


def build_loongforge(folder: str, device: H.Device, fp8: str | None = None, optimizer_precision: str = "fp32",
                     adam: str = "triton", fp8_recipe: str | None = None, cuda_graphs: str | None = None,
                     token_stats: str | None = None, adapt=None):
    """(step, info) of a loongforge-hf stack; ``adapt(model) -> model`` runs before ``MegatronEngine`` is built, as
    LoongTrainer builds it for a model given LoRA adapters (bench_lora.py)."""
    import tempfile

    import torch
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine, fused_adam_for

    megatron_config = {"cuda_graph_impl": cuda_graphs} if cuda_graphs else None
    if cuda_graphs:
        # NOTE: megatron's local graphs refuse expandable segments on pre-Blackwell GPUs unless NCCL does not register
        # graph buffers (cuda_graphs.py); one GPU, no NCCL traffic here.
        os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
    model = lf.AutoModelForCausalLM.from_pretrained(folder, tensor_parallel_size=1, dtype=torch.bfloat16, fp8=fp8,
                                                    fp8_recipe=fp8_recipe, megatron_config=megatron_config)
    if adapt is not None:
        model = adapt(model)
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench_train_"), learning_rate=LR,
                                          adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
                                          weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM, report_to=[])
    engine = MegatronEngine(model, args=args, optimizer_precision=optimizer_precision,
                            fused_adam=fused_adam_for(adam, model.device))
    engine.token_stats = token_stats == "on"  # NOTE: LoongSFTTrainer's per-token entropy and top-1 sums
    inner = engine.inner_optimizers()
    wrapper = type((getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer])[0]).__name__
    info = {"parameters": model.num_parameters(), "device": str(model.device),
            "optimizer": f"megatron {wrapper} over {type(inner[0]).__module__}.{type(inner[0]).__name__} "
                         f"(foreach={inner[0].defaults.get('foreach')}, fused={inner[0].defaults.get('fused')})",
            "optimizer_precision": optimizer_precision, "cuda_graphs": cuda_graphs,
            "token_stats": engine.token_stats,
            "attention": next(type(layer.self_attention.core_attention).__name__
                              for layer in model.chunks[0].decoder.layers
                              if hasattr(layer.self_attention, "core_attention")),
            "loss": "fused linear cross-entropy" if engine.fused_loss else "materialised logits",
            "triton_kernels": _triton_on(model.device),
            "fused_rope": bool(model.megatron.config.apply_rope_fusion)}
    mlp = model.chunks[0].decoder.layers[0].mlp
    if hasattr(mlp, "experts"):  # the routed experts' module (GroupedMLP unless LOONGFORGE_MOE_GROUPED_GEMM=0)
        info["experts"] = type(mlp.experts).__name__
    fp8_report = getattr(model.megatron, "fp8", None)
    if fp8_report is not None:  # --fp8: which layers run FP8 GEMMs (adaptive: the table is filled on the first step)
        info["fp8"] = {"mode": fp8, "recipe": fp8_report.recipe, "swapped": len(fp8_report.swapped),
                       "skipped": fp8_report.skipped}

    def step(micro_batches):
        return engine.train_step([{"input_ids": ids, "labels": ids} for ids in micro_batches]).loss

    step.fp8_report = fp8_report
    step.model = model  # NOTE: bench_fp8_modes.py swaps FP8 layers on and off the built model
    return step, info


def run_stack(args, device: H.Device) -> dict:
    if args.stack == "loongforge":
        step, info = build_loongforge(args.folder, device, fp8=args.fp8, optimizer_precision=args.optimizer_precision,
                                      adam=args.adam, fp8_recipe=args.fp8_recipe, cuda_graphs=args.cuda_graphs,
                                      token_stats=args.token_stats)
    else:
        step, info = build_transformers(args.folder, device, liger=args.stack == "liger")
    out = time_stack(step, info, args, device)
    fp8_report = getattr(step, "fp8_report", None)
    if fp8_report is not None and fp8_report.autotuner is not None:
        out["fp8_table"] = fp8_report.autotuner.table()  # fp8=adaptive: bf16-or-FP8 per GEMM shape
    return out


def time_stack(step, info: dict, args, device: H.Device) -> dict:
    """Time a built ``step`` on the workload's random token batches (``args``: the worker's shape, tiny,
    micro_batch, accum, warmup, steps, profile): ``info`` plus the timing, peak memory, layout and versions."""
    import torch

    w = WORKLOADS[args.shape]
    cfg_kwargs, seq, _ = sizes(w, args.tiny)
    info["weights_gib"] = round(device.allocated() / H.GIB, 2)
    g = torch.Generator(device=device.device).manual_seed(SEED)
    # NOTE: each step's rows are drawn at once and then split, so a run with accumulation sees the same tokens as one
    # without (drawing each micro-batch separately moves the generator differently).
    batches = [list(torch.randint(0, cfg_kwargs["vocab_size"], (args.micro_batch * args.accum, seq), generator=g,
                                  device=device.device).split(args.micro_batch))
               for _ in range(args.warmup + args.steps + (1 if args.profile else 0))]
    device.synchronize()
    device.reset_peak()
    timing = H.time_steps(step, batches[:args.warmup + args.steps], warmup=args.warmup, device=device)
    out = {**info, **timing, "peak_gib": round(device.peak() / H.GIB, 2),
           "peak_reserved_gib": round(device.peak_reserved() / H.GIB, 2), "micro_batch": args.micro_batch,
           "accum": args.accum, "seq": seq, "tokens_per_step": args.micro_batch * args.accum * seq,
           "device": device.describe(),
           "versions": H.versions("torch", "transformers", "megatron-core", "liger-kernel", "triton", "peft")}
    if args.profile:
        out["profile"] = H.profile_step(step, batches[-1], device=device, stacks=True)
        out["profile"]["idle_without_stacks"] = H.idle_step(step, batches[-1], device=device)
    return out


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """The worker flags every training benchmark's worker takes (this script's and bench_lora.py's)."""
    p.add_argument("--shape", required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--result", required=True)


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=("write", "run"), required=True)
    p.add_argument("--stack", choices=STACKS)
    add_worker_args(p)
    defaults = {"--optimizer-precision": "fp32", "--adam": "triton"}
    for flag, values in VARIANT_OPTIONS.values():
        p.add_argument(flag, choices=values, default=defaults.get(flag))
    args = p.parse_args(argv)
    # NOTE: loongforge-hf picks its device backend from this variable; set before anything imports the package.
    os.environ["LOONGFORGE_DEVICE"] = args.device
    device = H.Device(args.device)
    if args.worker == "write":
        run = lambda: write_checkpoint(WORKLOADS[args.shape], tiny=args.tiny, folder=Path(args.folder),  # noqa: E731
                                       device=device)
    else:
        run = lambda: run_stack(args, device)  # noqa: E731
    return H.worker_main(run, result_path=args.result, device=device)


# ---- parent side ---------------------------------------------------------------------------------------------

def flops_per_token(w: Workload, tiny: bool) -> float:
    from loongforge_hf.trainer.flops import model_flops_per_token

    _, seq, _ = sizes(w, tiny)
    return model_flops_per_token(hf_config(w, tiny), seq_len=seq)


def loongforge_supports(w: Workload) -> bool:
    from loongforge_hf.bridges import supported_architectures

    return ARCHITECTURES[w.model_type] in supported_architectures()


def measure(args, w: Workload, stack: str, folder: Path, log: Path, *, profile: bool) -> dict:
    _, seq, mb = sizes(w, args.tiny)
    # "loongforge fp8=on": loongforge with fp8="on"; "loongforge optimizer=model": optimizer_precision="model"
    base_stack, *options = stack.split(" ")
    options = dict(o.split("=", 1) for o in options)
    common = [__file__, "--worker", "run", "--shape", w.key, "--stack", base_stack, "--folder", str(folder),
              "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for key, value in options.items():
        common += [VARIANT_OPTIONS[key][0], value]
    common += (["--tiny"] if args.tiny else []) + (["--profile"] if profile else [])
    return measure_worker(common, args=args, label=stack, micro_batch=mb, log=log)


def measure_worker(common: list[str], *, args, label: str, micro_batch: int, log: Path, worker=None) -> dict:
    """Run the worker command ``common`` at ``micro_batch`` x ``args.accum`` micro-batches per step; one that runs out
    of memory at a micro-batch above 1 runs again at micro-batch 1 with as many more accumulated (same tokens per
    step), both facts kept. ``worker``: run it in this process (``H.run_worker``)."""
    mb = micro_batch
    result = H.run_worker(common + ["--micro-batch", str(mb), "--accum", str(args.accum)], log_path=log,
                          timeout_s=args.worker_timeout, worker=worker)
    print(f"  {label}: {_brief(result)}", flush=True)
    if result["status"] == "oom" and mb > 1 and not args.no_oom_retry:
        first = result
        result = H.run_worker(common + ["--micro-batch", "1", "--accum", str(mb * args.accum)], log_path=log,
                              timeout_s=args.worker_timeout, worker=worker)
        result["oom_at"] = {"micro_batch": mb, "peak_gib": first.get("peak_gib"), "error": first["error"][-1500:]}
        print(f"  {label} (micro-batch 1 x {mb} accumulation): {_brief(result)}", flush=True)
    return result


def ensure_checkpoint(args, w: Workload, entry: dict, log: Path, *, in_process: bool = False) -> Path | None:
    """The workload's checkpoint folder under ``args.checkpoints``, written by a worker unless it is there already;
    None when writing failed (the failure is kept in ``entry``). ``in_process``: write it in this process."""
    folder = Path(args.checkpoints) / (f"{w.key}-tiny" if args.tiny else w.key)
    if (folder / "config.json").is_file():
        return folder
    written = H.run_worker([__file__, "--worker", "write", "--shape", w.key, "--folder", str(folder),
                            "--device", args.device] + (["--tiny"] if args.tiny else []),
                           log_path=log, timeout_s=args.worker_timeout, worker=worker if in_process else None)
    entry["checkpoint"] = written
    if written["status"] != "ok":
        print(f"  writing the checkpoint failed: {_brief(written)}", flush=True)
        return None
    print(f"  checkpoint: {written['parameters'] / 1e9:.3f} B parameters, {written['worker_wall_s']} s", flush=True)
    return folder


def _brief(r: dict) -> str:
    if r["status"] != "ok":
        last = r.get("error", "").strip().splitlines()[-1:] or [""]
        return f"{r['status']}: {last[0][:200]}"
    fp8 = f", fp8 {r['fp8']['mode']} ({r['fp8']['recipe']} scaling)" if r.get("fp8") else ""
    return f"median step {r['median_step_s'] * 1e3:.1f} ms, peak {r['peak_gib']:.2f} GiB, losses {r['losses'][0]:.3f}" \
           f" -> {r['losses'][-1]:.3f}{fp8}"


def summarize(w: Workload, results: dict, *, flops: float, peak_flops: float) -> list[list]:
    for r in results.values():
        if r.get("status") == "ok":
            r["tokens_per_s"] = r["tokens_per_step"] / r["median_step_s"]
            r["mfu"] = r["tokens_per_s"] * flops / peak_flops
    rows = []
    base = {k: results.get(k, {}) for k in ("liger", "transformers")}
    for stack, r in results.items():
        name = STACK_TITLES.get(stack) or STACK_TITLES["loongforge"].replace("loongforge-hf", stack.replace(
            "loongforge", "loongforge-hf"))
        if stack == "transformers" and HF_ATTENTION.get(w.model_type):
            name = f"transformers ({HF_ATTENTION[w.model_type]})"
        if r.get("status") != "ok":
            rows.append([name, "—", f"**{r.get('status')}**", "—", _gib(r.get("peak_gib")), "—", "—", "—", "—"])
            continue
        ratios = []
        for ref in ("liger", "transformers"):
            b = base[ref]
            ratios.append(f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}×" if b.get("status") == "ok" else "—")
        mem_vs_liger = f"{r['peak_gib'] / base['liger']['peak_gib']:.2f}×" \
            if base["liger"].get("status") == "ok" and base["liger"]["peak_gib"] else "—"
        layout = f"{r['micro_batch']}" + (f" × {r['accum']} accum" if r["accum"] > 1 else "")
        if r.get("oom_at"):
            layout += f" (OOM at {r['oom_at']['micro_batch']})"
        rows.append([name, layout, f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f}%", _gib(r["peak_gib"]),
                     ratios[0], ratios[1], mem_vs_liger, f"{r['losses'][0]:.3f}"])
    return rows


def _gib(x) -> str:
    return "—" if x is None else f"{x:.1f}"


HEADER = ["stack", "micro-batch", "tokens/s", "MFU", "peak GiB", "tok/s vs HF+Liger", "tok/s vs HF",
          "peak vs HF+Liger", "first loss"]


def print_profile(title: str, prof: dict) -> None:
    """A worker's ``profile``: top ops and kernels, where the memory-bound passes come from, where the device waits."""
    print(f"\n{title}: wall {prof['wall_ms']} ms, {prof['measured']} {prof['total_self_ms']} ms")
    for what, rows in (("op", prof["ops"][:15]), ("kernel", prof["kernels"][:8])):
        print(H.markdown_table([what, "calls", "self ms", "share"],
                               [[t["name"][:70], t["calls"], t["self_ms"], f"{100 * t['share']:.1f}%"]
                                for t in rows]))
    for site in prof.get("call_sites", [])[:12]:
        print(f"  {site['name']} x{site['calls']} {site['self_ms']} ms <- " + " <- ".join(site["stack"][:4]))
    for name, idle in (("python frames recorded", prof.get("idle")),
                       ("without python frames", prof.get("idle_without_stacks"))):
        if not idle:
            continue
        print(f"  {name}: device busy {idle['busy_ms']} ms, idle {idle['idle_ms']} ms of {idle['span_ms']} ms; "
              "idle by (host sync the gap began in, site that launched the next kernel):")
        for row in idle["by_site"][:10]:
            print(f"  {row['ms']} ms in {row['gaps']} gaps: sync {' <- '.join(row['sync'][:3]) or '-'}; "
                  f"launch {' <- '.join(row['launch_site'][:2]) or '?'}")
        doing = [f"{r['doing'][:90]} {r['ms']} ms" for r in idle["host_in_gaps"][:12]]
        print("  the host during those gaps: " + "; ".join(doing))


def add_run_args(p: argparse.ArgumentParser, stacks, *, name: str, profile: str) -> None:
    """The flags every training benchmark's parent takes (this script's and bench_lora.py's); ``name`` names its
    default output and checkpoint folder, ``profile`` the workloads profiled by default."""
    p.add_argument("--shapes", default="a,b,c")
    p.add_argument("--stacks", default=",".join(stacks))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--profile", default=profile, help="workloads whose loongforge step is profiled ('' for none)")
    p.add_argument("--out", default=f"outputs/{name}.json")
    p.add_argument("--log", default=None, help="worker output (default: next to --out, .log)")
    p.add_argument("--checkpoints", default=f"/tmp/loongforge_{name}", help="where the checkpoints are written")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="small sizes, same code paths (dry runs, smoke)")
    p.add_argument("--no-oom-retry", action="store_true")
    p.add_argument("--worker-timeout", type=float, default=900.0)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, STACKS, name="bench_train", profile="a,c")
    p.add_argument("--profile-stack", default="loongforge", help="the row profiled, e.g. 'loongforge "
                   "optimizer=model'")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--fp8", default="", help="comma list of fp8 modes (on,adaptive): loongforge rows with "
                   "from_pretrained(fp8=mode) next to the bf16 one (docs/fp8.md)")
    p.add_argument("--optimizer-precision", default="fp32", help="comma list (fp32,model): 'model' adds a loongforge "
                   "row with MegatronEngine(optimizer_precision='model') (bf16 grads, weights and AdamW moments) next "
                   "to the default fp32 one")
    p.add_argument("--variants", default="", help="comma list of extra loongforge rows, each a space-separated set "
                   "of options: fp8=on|adaptive, recipe=blockwise|blockwise_wgrad2d|rowwise or, with "
                   "Transformer Engine, te_delayed|te_tensorwise|te_blockwise|te_mxfp8 (fp8_recipe), "
                   "optimizer=fp32|model, graphs=local (megatron's per-layer CUDA graphs), adam=triton|torch "
                   "(kernels/adamw.LoongAdamW, the default, or MegatronEngine(fused_adam=True): torch's fused AdamW), "
                   "stats=on (the engine's per-token entropy and top-1 sums, as LoongSFTTrainer runs it), "
                   "e.g. 'optimizer=model graphs=local adam=torch'")
    p.add_argument("--variants-only", action="store_true", help="leave out the plain loongforge row (fp32 state) "
                   "when --variants / --fp8 / --optimizer-precision add others")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    stacks = [s for s in args.stacks.split(",") if s]
    unknown = [s for s in shapes if s not in WORKLOADS] + [s for s in stacks if s not in STACKS]
    if unknown:
        p.error(f"unknown shapes/stacks {unknown}; shapes: {sorted(WORKLOADS)}, stacks: {list(STACKS)}")
    bad_fp8 = [m for m in args.fp8.split(",") if m and m not in VARIANT_OPTIONS["fp8"][1]]
    if bad_fp8:
        p.error(f"--fp8 takes on and/or adaptive, got {bad_fp8}")
    bad_precision = [m for m in args.optimizer_precision.split(",") if m and m not in VARIANT_OPTIONS["optimizer"][1]]
    if bad_precision:
        p.error(f"--optimizer-precision takes fp32 and/or model, got {bad_precision}")
    allowed = {key: values for key, (_, values) in VARIANT_OPTIONS.items()}
    for v in (v for v in args.variants.split(",") if v.strip()):
        for option in v.split():
            key, _, value = option.partition("=")
            if value not in allowed.get(key, ()):
                p.error(f"--variants: unknown option {option!r} in {v!r}; options: {allowed}")
    if "loongforge" in stacks:
        stacks += [f"loongforge fp8={m}" for m in args.fp8.split(",") if m]
        stacks += [f"loongforge optimizer={m}" for m in args.optimizer_precision.split(",") if m and m != "fp32"]
        stacks += [f"loongforge {v.strip()}" for v in args.variants.split(",") if v.strip()]
        if args.variants_only:
            stacks = [s for s in stacks if s != "loongforge"]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log = Path(args.log) if args.log else out_path.with_suffix(".log")
    log.write_text("")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "peak_tflops": args.peak_tflops,
              "settings": {"steps": args.steps, "warmup": args.warmup, "lr": LR, "betas": BETAS, "eps": EPS,
                           "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM, "tiny": args.tiny,
                           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
              "mfu_formula": "model_flops_per_token (loongforge_hf/trainer/flops.py): 3*(L*(2h(q+2kv) + 2qh + 6hfk "
                             "+ 2qs) + 2hV) per token (4hfk for an ungated MLP)", "workloads": {}}
    tables = []
    for key in shapes:
        w = WORKLOADS[key]
        cfg, seq, mb = sizes(w, args.tiny)
        flops = flops_per_token(w, args.tiny)
        entry = {"title": w.title, "config": cfg, "seq": seq, "micro_batch": mb, "flops_per_token": flops,
                 "results": {}}
        report["workloads"][key] = entry
        print(f"[{key}] {w.title}{' (tiny)' if args.tiny else ''}: {flops / 1e9:.2f} GFLOP/token", flush=True)
        folder = ensure_checkpoint(args, w, entry, log)
        if folder is None:
            H.save_json(report, out_path)
            continue
        for stack in stacks:
            if stack.startswith("loongforge") and not loongforge_supports(w):
                entry["results"][stack] = {"status": "not run",
                                           "error": f"no loongforge-hf bridge for {ARCHITECTURES[w.model_type]}"}
                continue
            entry["results"][stack] = measure(args, w, stack, folder, log,
                                              profile=stack == args.profile_stack and key in args.profile.split(","))
            H.save_json(report, out_path)
        rows = summarize(w, entry["results"], flops=flops, peak_flops=args.peak_tflops * 1e12)
        tables.append(f"### ({key}) {w.title}\n\n" + H.markdown_table(HEADER, rows))
        bf16 = entry["results"].get("loongforge", {})
        for stack, r in entry["results"].items():
            if " fp8=" in stack and r.get("status") == "ok" and bf16.get("status") == "ok":
                fp8_info = r.get("fp8") or {}
                tables[-1] += (f"\n\n{stack}: {r['tokens_per_s'] / bf16['tokens_per_s']:.3f}x loongforge bf16 tokens/s"
                               f" ({fp8_info.get('recipe')} scaling, {fp8_info.get('swapped')} layers swapped)")
            if " optimizer=" in stack and r.get("status") == "ok" and bf16.get("status") == "ok":
                tables[-1] += (f"\n\n{stack}: {r['tokens_per_s'] / bf16['tokens_per_s']:.3f}x loongforge "
                               f"fp32-optimizer tokens/s, peak {r['peak_gib']:.2f} vs {bf16['peak_gib']:.2f} GiB "
                               f"({r['optimizer']})")
        H.save_json(report, out_path)
        if not args.keep_checkpoints:
            shutil.rmtree(folder, ignore_errors=True)
    finish_report(report, tables, out_path=out_path, log=log, profile_stack=args.profile_stack,
                  profile_title=args.profile_stack)
    return 0


def finish_report(report: dict, tables: list[str], *, out_path, log, profile_stack: str, profile_title: str) -> None:
    """The run's device and software (from the first row that has them) into the saved JSON; the tables and the
    profiled stack's step profiles printed (this script's and bench_lora.py's end)."""
    rows = [r for e in report["workloads"].values() for r in e["results"].values()]
    report["device"] = next((r["device"] for r in rows if r.get("device")), None)
    report["software"] = next((r["versions"] for r in rows if r.get("versions")), None)
    H.save_json(report, out_path)
    print(f"\ndevice: {report['device']}\n")
    print("\n\n".join(tables))
    for key, e in report["workloads"].items():
        prof = e["results"].get(profile_stack, {}).get("profile")
        if prof:
            print_profile(f"{profile_title} step profile, ({key})", prof)
    print(f"\nwrote {out_path} and {log}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(worker(sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))
