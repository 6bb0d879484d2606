"""megatron's per-layer CUDA graphs (``megatron_config={"cuda_graph_impl": "local"}``) under MegatronEngine on a GPU:
the same losses and weights as the eager run, with both optimizer precisions and the fused weight-gradient
accumulation (whose ``grad_added_to_main_grad`` flags a replayed backward does not set); and a bf16 MoE model
(expert parallel 1, ``bridges/moe_graphs.py``) whose MoE layers are captured, with the eager run's losses.

This failed on an H100 (0.3% on the first replayed step's loss) until the first layer's input norm got a copy of its
input (``bridges/builder._keep_graph_input``): a per-parameter comparison at lr 0 showed that layer's input-norm
weight and input grads ~10x off and every other grad exact. fp32 weights keep GEMM rounding (captured vs eager
algorithms) at rounding level; in bf16 Adam turns such differences of near-zero grads into full-size updates."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# megatron captures after cuda_graph_warmup_steps (3) eager passes: 8 steps run 4 or more from the graphs.
STEPS = 8


def _load(folder: str, graphs: bool, **kwargs):
    """``from_pretrained`` with megatron's local CUDA graphs asked for, or not."""
    import os

    import loongforge_hf as lf

    if graphs:
        os.environ["NCCL_GRAPH_REGISTER"] = "0"  # megatron's check with expandable segments (no NCCL use here)
    return lf.AutoModelForCausalLM.from_pretrained(
        folder, megatron_config={"cuda_graph_impl": "local"} if graphs else None, **kwargs)


def _train_steps(model, out_dir: str, *, lr: float, weight_decay: float = 0.0, optimizer_precision: str = "fp32"):
    """(engine, STEPS losses, the two batches, their generator): a MegatronEngine's steps on two batches in turn
    (later steps on the same batch must have learnt it: random tokens otherwise carry nothing)."""
    import transformers

    from loongforge_hf.trainer.engine import MegatronEngine

    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=lr, weight_decay=weight_decay,
                                          max_grad_norm=1.0, report_to=[])
    engine = MegatronEngine(model, args=args, optimizer_precision=optimizer_precision)
    g = torch.Generator().manual_seed(3)
    pair = [torch.randint(4, model.config.vocab_size, (2, 64), generator=g).cuda() for _ in range(2)]
    losses = [engine.train_step([{"input_ids": pair[i % 2], "labels": pair[i % 2]}]).loss for i in range(STEPS)]
    return engine, losses, pair, g


def _recorded(chunk) -> list:
    """The modules of ``chunk`` whose forward graph megatron recorded."""
    return [m for m in chunk.modules() if hasattr(m, "cudagraph_manager")
            and any(r.fwd_graph_recorded for r in m.cudagraph_manager.cudagraph_runners)]


def _train(folder: str, out_dir: str, graphs: bool, optimizer_precision: str) -> dict:
    model = _load(folder, graphs, tensor_parallel_size=1, dtype=torch.float32)
    engine, losses, _, _ = _train_steps(model, out_dir, lr=1e-3, weight_decay=0.01,
                                        optimizer_precision=optimizer_precision)
    # numpy: tensors from a finished child process cannot be rebuilt from its shared memory
    weights = {k: v.float().cpu().numpy() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    return {"losses": losses, "weights": weights, "fused_wgrad_layers": engine.fused_wgrad_layers,
            "graphed": sum(hasattr(m, "cudagraph_manager") for m in model.chunks[0].modules())}


@pytest.mark.parametrize("optimizer_precision", ["fp32", "model"])
def test_local_cuda_graphs_train_like_eager(tmp_path, optimizer_precision):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=False, hidden_size=128,
                                  intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    env = {"LOONGFORGE_DEVICE": "cuda", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    [eager] = run_distributed(_train, 1, str(folder), str(tmp_path / "e"), False, optimizer_precision, timeout=600,
                              env=env)
    [graphed] = run_distributed(_train, 1, str(folder), str(tmp_path / "g"), True, optimizer_precision, timeout=600,
                                env=env)
    assert graphed["graphed"] > 0 and graphed["fused_wgrad_layers"] > 0, graphed
    # The same computation replayed: equal up to fp32 rounding (GEMM algorithms may differ under capture).
    torch.testing.assert_close(torch.tensor(graphed["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-5)
    for name, w in eager["weights"].items():
        torch.testing.assert_close(torch.from_numpy(graphed["weights"][name]), torch.from_numpy(w), rtol=1e-4,
                                   atol=1e-5, msg=name)
    assert graphed["losses"][-1] < graphed["losses"][1] and graphed["losses"][-2] < graphed["losses"][0]


def _train_moe(folder: str, out_dir: str, graphs: bool) -> dict:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    model = _load(folder, graphs, dtype=torch.bfloat16)
    _, losses, _, _ = _train_steps(model, out_dir, lr=1e-4, weight_decay=0.01)
    layers = [m for m in model.chunks[0].modules() if hasattr(m, "cudagraph_manager")]
    moe_graphed = [m for m in _recorded(model.chunks[0]) if isinstance(getattr(m, "mlp", None), MoELayer)]
    bias = [m.expert_bias.float().cpu().numpy() for m in model.chunks[0].modules()
            if getattr(m, "expert_bias", None) is not None]
    return {"losses": losses, "layers": len(layers), "moe_graphed": len(moe_graphed), "expert_bias": bias}


MOE_SIZES = {"qwen3_moe": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
             "mixtral": {}, "deepseek_v3": {}}


@pytest.mark.parametrize("arch", sorted(MOE_SIZES))
def test_local_cuda_graphs_train_a_moe_model_like_eager(tmp_path, arch):
    """A bf16 MoE model (expert parallel 1: the sync-free allgather dispatch, grouped experts on torch._grouped_mm;
    DeepSeek-V3: multi-latent attention, shared experts, sigmoid routing with the expert bias' token counts) under
    megatron's per-layer graphs: its MoE layers are captured and replayed, and the 8 losses equal the eager run's
    within 2e-3 (bf16 weights, lr 1e-4, fp32 optimizer state: captured GEMMs may pick other algorithms)."""
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "ckpt", arch, tokenizer=False, **MOE_SIZES[arch])
    env = {"LOONGFORGE_DEVICE": "cuda", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    [eager] = run_distributed(_train_moe, 1, str(folder), str(tmp_path / "e"), False, timeout=600, env=env)
    [graphed] = run_distributed(_train_moe, 1, str(folder), str(tmp_path / "g"), True, timeout=600, env=env)
    assert eager["layers"] == 0 and graphed["moe_graphed"] >= 3, (eager, graphed)
    if arch == "deepseek_v3":
        # NOTE: the expert bias moves by the token counts accumulated inside the captured forwards, as in eager
        assert len(graphed["expert_bias"]) == len(eager["expert_bias"]) > 0
        for ours, theirs in zip(graphed["expert_bias"], eager["expert_bias"]):
            assert abs(theirs).sum() > 0 and (ours == theirs).all(), (ours, theirs)
    torch.testing.assert_close(torch.tensor(graphed["losses"]), torch.tensor(eager["losses"]), rtol=0, atol=2e-3)
    assert graphed["losses"][-1] < graphed["losses"][1] and graphed["losses"][-2] < graphed["losses"][0]


def _train_lora(folder: str, out_dir: str, graphs: bool) -> dict:
    import peft

    from loongforge_hf.lora import get_peft_model

    model = _load(folder, graphs, dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                  init_lora_weights=False))
    _, losses, _, _ = _train_steps(model, out_dir, lr=1e-4)
    graphed = _recorded(model.chunks[0])
    return {"losses": losses, "graphed": len(graphed)}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_local_cuda_graphs_train_lora_like_eager(tmp_path, arch):
    """LoRA adapters (attached after from_pretrained set the graphs up; experts and router included on the MoE
    model) under megatron's per-layer graphs: the layers are captured and the 8 losses equal the eager run's within
    2e-3 (bf16, lr 1e-4). Needs the embedding output to require grad
    (``LoongModelForCausalLM.embedding_output_requires_grad``)."""
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "ckpt", arch, tokenizer=False, hidden_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32)
    env = {"LOONGFORGE_DEVICE": "cuda", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    [eager] = run_distributed(_train_lora, 1, str(folder), str(tmp_path / "e"), False, timeout=600, env=env)
    [graphed] = run_distributed(_train_lora, 1, str(folder), str(tmp_path / "g"), True, timeout=600, env=env)
    assert eager["graphed"] == 0 and graphed["graphed"] >= 3, (eager, graphed)
    torch.testing.assert_close(torch.tensor(graphed["losses"]), torch.tensor(eager["losses"]), rtol=0, atol=2e-3)


def _train_then_use(folder: str, out_dir: str, graphs: bool) -> dict:
    """Train STEPS graphed (or eager) steps, then what a user does next: evaluate at the training shape and at
    another one (eval mode, no grad), call the model without grad in train mode, and generate."""
    model = _load(folder, graphs, dtype=torch.float32)
    _, losses, pair, g = _train_steps(model, out_dir, lr=1e-3)
    other = torch.randint(4, model.config.vocab_size, (1, 40), generator=g).cuda()
    out = {"losses": losses, "graphed": len(_recorded(model.chunks[0]))}
    with torch.no_grad():
        out["train_mode_no_grad"] = model(input_ids=other).logits.cpu().numpy()
        model.eval()
        out["eval_same_shape"] = model(input_ids=pair[0], labels=pair[0]).loss.item()
        out["eval_other_shape"] = model(input_ids=other).logits.cpu().numpy()
    model.train()  # NOTE: generate right after training, as a user would without model.eval()
    out["generated"] = model.generate(input_ids=other[:, :16], max_new_tokens=6, do_sample=False).cpu().tolist()
    return out


def test_local_cuda_graphs_then_evaluate_and_generate(tmp_path):
    """After graphed training steps, evaluation (eval mode, at the training shape and another one), a forward without
    grad in train mode and ``generate`` run the layers eagerly (``builder._graphs_in_training_only``) and agree with
    the eager-trained model: losses and logits within 1e-4 (fp32; the weights agree to ~1e-5), the same tokens.
    Before, megatron-core 0.16 sent these calls to its graph manager: an AssertionError at another shape."""
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=False, hidden_size=128,
                                  intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    env = {"LOONGFORGE_DEVICE": "cuda", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    [eager] = run_distributed(_train_then_use, 1, str(folder), str(tmp_path / "e"), False, timeout=600, env=env)
    [graphed] = run_distributed(_train_then_use, 1, str(folder), str(tmp_path / "g"), True, timeout=600, env=env)
    assert eager["graphed"] == 0 and graphed["graphed"] >= 2, graphed["graphed"]
    torch.testing.assert_close(torch.tensor(graphed["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-5)
    same = (graphed["eval_same_shape"], eager["eval_same_shape"])
    assert abs(same[0] - same[1]) < 1e-4, same
    for key in ("train_mode_no_grad", "eval_other_shape"):
        torch.testing.assert_close(torch.from_numpy(graphed[key]), torch.from_numpy(eager[key]), rtol=1e-4,
                                   atol=1e-4, msg=key)
    assert graphed["generated"] == eager["generated"]


def _loong_trainer(folder: str, out_dir: str, graphs: bool, fp8) -> dict:
    import os
    import sys

    import loongforge_hf as lf

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from tests.trainer._train_parity import losses_of, make_dataset, training_args

    model = _load(folder, graphs, dtype=torch.bfloat16, fp8=fp8)
    # NOTE: evaluation every 4 steps at batch 1 (training runs batch 2): the second one after the graphs were captured
    args = training_args(out_dir, use_cpu=False, bf16=True, max_steps=8, gradient_accumulation_steps=1,
                         learning_rate=1e-3, eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=1)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=make_dataset(n=16),
                              eval_dataset=make_dataset(n=4, seed=11))
    trainer.train()
    return {"losses": losses_of(trainer.state.log_history),
            "eval": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
            "graphed": len(_recorded(model.chunks[0])),
            "fp8_swapped": len(model.megatron.fp8.swapped) if fp8 else 0}


@pytest.mark.parametrize("fp8", [None, "on"])
def test_local_cuda_graphs_under_loong_trainer_with_evaluation(tmp_path, fp8):
    """LoongTrainer's loop on a graphed bf16 model (this backend's FP8 linears too), evaluating every 4 steps at
    another batch size than training's: training and evaluation losses equal the eager run's within 2e-3 (bf16)."""
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=False, hidden_size=128,
                                  intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    env = {"LOONGFORGE_DEVICE": "cuda", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    [eager] = run_distributed(_loong_trainer, 1, str(folder), str(tmp_path / "e"), False, fp8, timeout=600, env=env)
    [graphed] = run_distributed(_loong_trainer, 1, str(folder), str(tmp_path / "g"), True, fp8, timeout=600, env=env)
    assert eager["graphed"] == 0 and graphed["graphed"] >= 2, graphed
    assert (graphed["fp8_swapped"] > 0) == (fp8 is not None), graphed
    assert len(graphed["losses"]) == 8 and len(graphed["eval"]) == 2, graphed
    torch.testing.assert_close(torch.tensor(graphed["losses"]), torch.tensor(eager["losses"]), rtol=0, atol=2e-3)
    torch.testing.assert_close(torch.tensor(graphed["eval"]), torch.tensor(eager["eval"]), rtol=0, atol=2e-3)
