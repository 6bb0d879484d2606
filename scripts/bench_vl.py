"""Single-device training speed of Qwen2.5-VL, Qwen3-VL or Gemma 3, side by side: transformers (sdpa) vs loongforge-hf.

Workload (``--model qwen2_5_vl``, the default): the Qwen2.5-VL-3B shape cut in layers (language model 36 -> 8
layers: hidden 2048, intermediate 11008, 16 heads, 2 KV heads, vocab 151936, tied embeddings, mrope sections
16/24/24; vision tower depth 32 -> 8: hidden 1280, intermediate 3420, 16 heads, patch 14, 2x2 merge, windows of 112
pixels, block 7 full attention), random init written once by transformers
(``Qwen2_5_VLForConditionalGeneration(config)`` in bf16, seed 0, ``save_pretrained``).
``--model qwen3_vl``: the Qwen3-VL-4B shape cut the same way (language model 36 -> 8 layers: hidden 2560,
intermediate 9728, 32 heads, 8 KV heads of 128, vocab 151936, tied embeddings, interleaved mrope sections 24/20/20;
vision tower depth 24 -> 8: hidden 1024, intermediate 4096, 16 heads, patch 16, 2x2 merge, a 48x48 learned position
grid, DeepStack from blocks 1, 3, 5). ``--model gemma3``: the gemma-3-4b shape cut the same way (language model
34 -> 8 layers: hidden 2560, intermediate 10240, 8 heads, 4 KV heads of 256, vocab 262208, sliding windows of 1024
on all but layer 5, rope 1e4 / 1e6 with linear factor 8; SigLIP depth 27 -> 8: hidden 1152, intermediate 4304, 16
heads, 896x896 images of 14-pixel patches pooled to 256 tokens); its images are 896x896 (its only size) and each
stack gets ``token_type_ids`` (bidirectional attention within an image) and whole ``[n, 3, 896, 896]`` images.
A batch is ``--samples`` samples of ``--images`` random 448x448 images (1024
patches and 256 merged tokens each; 784 and 196 with Qwen3-VL's 16-pixel patches) and ``--text``
text tokens; image tokens carry label -100. Both stacks get the same tensors (``input_ids``, ``labels``,
``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``); the 3-D rope positions are computed by each stack from
them, as in training.

One training step: forward with labels (mean loss over label tokens), backward, gradient clipping at 1.0, AdamW (lr
1e-5, no weight decay). transformers: bf16 weights, torch's fused AdamW. loongforge-hf:
``AutoModelForImageTextToText.from_pretrained(dtype=bf16)`` and ``MegatronEngine`` (megatron's DDP and distributed
optimizer, fp32 main weights and gradients), the step LoongTrainer takes. Each stack runs in its own process
(``_bench_harness``): median step time over ``--steps`` after ``--warmup``, allocator peak, losses; JSON to --out.

    python scripts/bench_vl.py [--model qwen2_5_vl|qwen3_vl|gemma3] [--steps 10] [--warmup 3] [--samples 4] [--images 1]
                               [--text 1024]
                               [--stacks transformers,loongforge] [--vision-recompute] [--language-recompute]
                               [--out outputs/bench_vl.json]
    python scripts/bench_vl.py --tiny --device cpu          # a dry run
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402

STACKS = ("transformers", "loongforge")
TITLES = {"transformers": "transformers (sdpa)", "loongforge": "loongforge-hf (TP=1, MegatronEngine)"}
LR, MAX_GRAD_NORM, SEED = 1e-5, 1.0, 0
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 151655, 151656, 151652, 151653


MODELS = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
          "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
          "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration")}
GEMMA3_BOI, GEMMA3_EOI, GEMMA3_IMAGE = 255999, 256000, 262144


def config_kwargs(tiny: bool, model: str = "qwen2_5_vl") -> dict:
    if model == "qwen3_vl":
        return qwen3_vl_config_kwargs(tiny)
    if model == "gemma3":
        return gemma3_config_kwargs(tiny)
    if tiny:
        text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
        vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
                      tokens_per_second=2)
        ids = dict(vision_start_token_id=500, vision_end_token_id=501, image_token_id=502, video_token_id=503)
    else:
        text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
        vision = dict(depth=8, hidden_size=1280, num_heads=16, intermediate_size=3420, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, window_size=112,
                      fullatt_block_indexes=[7], tokens_per_second=2, in_channels=3)
        ids = dict(vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, image_token_id=IMAGE_TOKEN,
                   video_token_id=VIDEO_TOKEN)
    return {"text_config": text, "vision_config": vision, "tie_word_embeddings": True, **ids}


def qwen3_vl_config_kwargs(tiny: bool) -> dict:
    ids = dict(vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, image_token_id=IMAGE_TOKEN,
               video_token_id=VIDEO_TOKEN)
    if tiny:
        text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                     "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1])
        ids = dict(vision_start_token_id=500, vision_end_token_id=501, image_token_id=502, video_token_id=503)
    else:
        text = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=8,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                        "mrope_section": [24, 20, 20], "mrope_interleaved": True})
        vision = dict(depth=8, hidden_size=1024, num_heads=16, intermediate_size=4096, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2560, num_position_embeddings=2304,
                      deepstack_visual_indexes=[1, 3, 5], in_channels=3)
    return {"text_config": text, "vision_config": vision, "tie_word_embeddings": True, **ids}


def gemma3_config_kwargs(tiny: bool) -> dict:
    if tiny:
        text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096)
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                      patch_size=7, vision_use_head=False)
        return {"text_config": text, "vision_config": vision, "mm_tokens_per_image": 16, "boi_token_index": 500,
                "eoi_token_index": 501, "image_token_index": 502}
    layer_types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    text = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                sliding_window=1024, layer_types=layer_types, max_position_embeddings=131072,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=8, num_attention_heads=16,
                  image_size=896, patch_size=14, vision_use_head=False)
    return {"text_config": text, "vision_config": vision, "mm_tokens_per_image": 256, "boi_token_index": GEMMA3_BOI,
            "eoi_token_index": GEMMA3_EOI, "image_token_index": GEMMA3_IMAGE}


def image_side(tiny: bool, model: str = "qwen2_5_vl") -> int:
    if model == "gemma3":
        return 56 if tiny else 896
    return (64 if model == "qwen3_vl" else 56) if tiny else 448


def write_checkpoint(*, tiny: bool, folder: Path, device: H.Device, model_name: str) -> dict:
    import torch
    import transformers

    config_class, model_class = MODELS[model_name]
    cfg = getattr(transformers, config_class)(**config_kwargs(tiny, model_name))
    cfg.architectures = [model_class]
    torch.manual_seed(SEED)
    with device.device:
        model = getattr(transformers, model_class)(cfg).to(torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    os.replace(partial, folder)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "vision_parameters": sum(p.numel() for p in getattr(model.model, "visual", None) or
                                     model.model.vision_tower.parameters()), "folder": str(folder)}


def make_batch(args, gen, device) -> dict:
    """One step's batch: per sample, ``images`` x (vision start, image tokens, vision end) then text tokens."""
    import torch

    if args.model == "gemma3":
        return gemma3_batch(args, gen, device)
    kw = config_kwargs(args.tiny, args.model)
    patch, merge = kw["vision_config"]["patch_size"], kw["vision_config"]["spatial_merge_size"]
    side = image_side(args.tiny, args.model) // patch
    per_image = side * side // merge ** 2
    width = 3 * kw["vision_config"]["temporal_patch_size"] * patch * patch
    rows, kinds = [], []
    for _ in range(args.samples):
        ids, types = [], []
        for _ in range(args.images):
            ids += [kw["vision_start_token_id"]] + [kw["image_token_id"]] * per_image + [kw["vision_end_token_id"]]
            types += [0] + [1] * per_image + [0]
        text = torch.randint(0, min(kw["vision_start_token_id"], kw["text_config"]["vocab_size"]) - 1, (args.text,),
                             generator=gen)
        rows.append(torch.tensor(ids + text.tolist()))
        kinds.append(torch.tensor(types + [0] * args.text))
    input_ids = torch.stack(rows)
    labels = input_ids.clone()
    labels[torch.stack(kinds) != 0] = -100
    n_images = args.samples * args.images
    pixels = torch.randn(n_images * side * side, width, generator=gen)
    grid = torch.tensor([[1, side, side]] * n_images)
    return {k: v.to(device) for k, v in dict(input_ids=input_ids, labels=labels, mm_token_type_ids=torch.stack(kinds),
                                             attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                                             image_grid_thw=grid).items()}


def gemma3_batch(args, gen, device) -> dict:
    """Per sample, ``images`` x (begin-of-image, 256 image tokens, end-of-image) then text tokens; whole images."""
    import torch

    kw = config_kwargs(args.tiny, "gemma3")
    per_image, side = kw["mm_tokens_per_image"], image_side(args.tiny, "gemma3")
    image = [kw["boi_token_index"]] + [kw["image_token_index"]] * per_image + [kw["eoi_token_index"]]
    rows = [torch.tensor(image * args.images + torch.randint(10, kw["boi_token_index"] - 1, (args.text,),
                                                             generator=gen).tolist()) for _ in range(args.samples)]
    input_ids = torch.stack(rows)
    types = (input_ids == kw["image_token_index"]).long()
    labels = input_ids.masked_fill(types == 1, -100)
    pixels = torch.randn(args.samples * args.images, 3, side, side, generator=gen)
    return {k: v.to(device) for k, v in dict(input_ids=input_ids, labels=labels, token_type_ids=types,
                                             attention_mask=torch.ones_like(input_ids), pixel_values=pixels).items()}


def build_transformers(folder: str, device: H.Device):
    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="sdpa", device_map=str(device.device))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=device.is_cuda)
    info = {"attn_implementation": model.config._attn_implementation,
            "optimizer": f"torch AdamW fused={device.is_cuda}", "parameters": sum(p.numel() for p in params)}

    def step(batch):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, info


def build_loongforge(folder: str, device: H.Device, args):
    import tempfile

    import torch
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16,
                                                           vision_recompute=args.vision_recompute,
                                                           language_recompute=args.language_recompute)
    targs = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench_vl_"), learning_rate=LR,
                                           weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM, report_to=[])
    engine = MegatronEngine(model, args=targs)
    inner = engine.inner_optimizers()
    info = {"parameters": sum(p.numel() for p in model.parameters()), "device": str(model.device),
            "vision_layout": model.vision_layout, "vision_recompute": args.vision_recompute,
            "language_recompute": args.language_recompute,
            "optimizer": f"megatron DistributedOptimizer over {type(inner[0]).__module__}.{type(inner[0]).__name__}"}

    def step(batch):
        return engine.train_step([batch]).loss

    return step, info


def run_stack(args, device: H.Device) -> dict:
    import torch

    step, info = build_loongforge(args.folder, device, args) if args.stack == "loongforge" \
        else build_transformers(args.folder, device)
    info["weights_gib"] = round(device.allocated() / H.GIB, 2)
    gen = torch.Generator().manual_seed(SEED)
    batches = [make_batch(args, gen, device.device) for _ in range(args.warmup + args.steps)]
    device.synchronize()
    device.reset_peak()
    timing = H.time_steps(step, batches, warmup=args.warmup, device=device)
    seq = batches[0]["input_ids"].shape[1]
    return {**info, **timing, "peak_gib": round(device.peak() / H.GIB, 2),
            "peak_reserved_gib": round(device.peak_reserved() / H.GIB, 2), "samples": args.samples, "seq": seq,
            "tokens_per_step": args.samples * seq, "images_per_step": args.samples * args.images,
            "device": device.describe(), "versions": H.versions("torch", "transformers", "megatron-core")}


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=("write", "run"), required=True)
    p.add_argument("--stack", choices=STACKS)
    p.add_argument("--folder", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model", choices=tuple(MODELS), default="qwen2_5_vl")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--images", type=int, default=1)
    p.add_argument("--text", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vision-recompute", action="store_true")
    p.add_argument("--language-recompute", action="store_true")
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)
    os.environ["LOONGFORGE_DEVICE"] = args.device
    device = H.Device(args.device)
    if args.worker == "write":
        run = lambda: write_checkpoint(tiny=args.tiny, folder=Path(args.folder), device=device,  # noqa: E731
                                       model_name=args.model)
    else:
        run = lambda: run_stack(args, device)  # noqa: E731
    return H.worker_main(run, result_path=args.result, device=device)


def _brief(r: dict) -> str:
    if r["status"] != "ok":
        last = r.get("error", "").strip().splitlines()[-1:] or [""]
        return f"{r['status']}: {last[0][:200]}"
    return f"median step {r['median_step_s'] * 1e3:.1f} ms, peak {r['peak_gib']:.2f} GiB, losses {r['losses'][0]:.4f}" \
           f" -> {r['losses'][-1]:.4f}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stacks", default=",".join(STACKS))
    p.add_argument("--model", choices=tuple(MODELS), default="qwen2_5_vl")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--images", type=int, default=1, help="448x448 images per sample")
    p.add_argument("--text", type=int, default=1024, help="text tokens per sample")
    p.add_argument("--vision-recompute", action="store_true", help="loongforge: checkpoint each ViT block")
    p.add_argument("--language-recompute", action="store_true", help="loongforge: checkpoint each decoder layer")
    p.add_argument("--out", default="outputs/bench_vl.json")
    p.add_argument("--checkpoint", default="/tmp/loongforge_bench_vl")
    p.add_argument("--keep-checkpoint", action="store_true")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="small sizes, same code paths (dry runs)")
    p.add_argument("--worker-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    stacks = [s for s in args.stacks.split(",") if s]
    if any(s not in STACKS for s in stacks):
        p.error(f"stacks: {list(STACKS)}")
    if args.tiny:
        args.text = min(args.text, 32)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log = out_path.with_suffix(".log")
    log.write_text("")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "config": config_kwargs(args.tiny, args.model),
              "settings": {k: getattr(args, k) for k in ("model", "steps", "warmup", "samples", "images", "text",
                                                         "tiny", "vision_recompute", "language_recompute")}
              | {"image_side": image_side(args.tiny, args.model), "lr": LR, "max_grad_norm": MAX_GRAD_NORM},
              "results": {}}
    folder = Path(f"{args.checkpoint}-{args.model}" + ("-tiny" if args.tiny else ""))
    if not (folder / "config.json").is_file():
        written = H.run_worker([__file__, "--worker", "write", "--folder", str(folder), "--device", args.device,
                                "--model", args.model] + (["--tiny"] if args.tiny else []), log_path=log,
                               timeout_s=args.worker_timeout)
        report["checkpoint"] = written
        if written["status"] != "ok":
            print(f"writing the checkpoint failed: {_brief(written)}")
            H.save_json(report, out_path)
            return 1
        print(f"checkpoint: {written['parameters'] / 1e9:.3f} B parameters "
              f"({written['vision_parameters'] / 1e9:.3f} B vision), {written['worker_wall_s']} s", flush=True)
    common = ["--folder", str(folder), "--device", args.device, "--model", args.model, "--steps", str(args.steps),
              "--warmup",
              str(args.warmup), "--samples", str(args.samples), "--images", str(args.images), "--text",
              str(args.text)] + (["--tiny"] if args.tiny else []) \
        + (["--vision-recompute"] if args.vision_recompute else []) \
        + (["--language-recompute"] if args.language_recompute else [])
    for stack in stacks:
        r = H.run_worker([__file__, "--worker", "run", "--stack", stack, *common], log_path=log,
                         timeout_s=args.worker_timeout)
        report["results"][stack] = r
        print(f"  {stack}: {_brief(r)}", flush=True)
        H.save_json(report, out_path)
    rows = []
    base = report["results"].get("transformers", {})
    for stack, r in report["results"].items():
        if r.get("status") != "ok":
            rows.append([TITLES[stack], r.get("status"), "", "", "", ""])
            continue
        r["tokens_per_s"] = r["tokens_per_step"] / r["median_step_s"]
        speedup = base["median_step_s"] / r["median_step_s"] if base.get("status") == "ok" else None
        rows.append([TITLES[stack], f"{r['median_step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['peak_gib']:.2f}", f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                     f"{speedup:.2f}x" if speedup else ""])
    report["device"] = next((r["device"] for r in report["results"].values() if r.get("device")), None)
    H.save_json(report, out_path)
    print(f"\ndevice: {report['device']}\n")
    print(H.markdown_table(["stack", "median step ms", "tokens/s", "peak GiB", "loss first -> last",
                            "vs transformers"], rows))
    if not args.keep_checkpoint:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nwrote {out_path} and {log}")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(worker(sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))
