"""OPT's default positions, counted from the attention mask as transformers counts them (``cumsum(attention_mask) *
attention_mask - 1``: ``absolute_positions.mask_positions``), on left-padded batches without ``position_ids``, in one
two-rank world: at TP2 + SP the logits (real tokens) and the loss of an uncached forward, a cached step after a
left-padded prefill (transformers' ``past_key_values_length`` slicing) and greedy generate of left-padded prompts
against transformers; LoongTrainer's first step on left-padded rows (its loss and gradient norm, the learning rate 0)
against transformers' loss and gradient norm; LoongGRPOTrainer (TRL left-pads the prompts) at DP2 against
trl.GRPOTrainer under DDP (logs 1e-4, the final weights within 1% of how far TRL moved them). fp32."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
TP2_SP = {"tensor_parallel_size": 2, "sequence_parallel": True}


def _batch():
    ids = torch.randint(4, 200, (3, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # NOTE: left-padded rows, one right-padded
    mask[2, :7] = 0
    mask[0, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _forwards(folder: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.kv_cache import LoongKVCache

    ids, mask, labels = _batch()
    real = mask.bool()
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **TP2_SP)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        got, want = model(input_ids=ids, attention_mask=mask, labels=labels), ref(input_ids=ids, attention_mask=mask,
                                                                                  labels=labels)
        out["logits"] = float((got.logits - want.logits)[real].abs().max())
        out["loss"] = abs(float(got.loss) - float(want.loss))
        cache, theirs = LoongKVCache.for_model(model), transformers.DynamicCache(config=ref.config)
        model(input_ids=ids[:, :8], attention_mask=mask[:, :8], cache=cache)
        ref(input_ids=ids[:, :8], attention_mask=mask[:, :8], past_key_values=theirs, use_cache=True)
        step = model(input_ids=ids[:, 8:], attention_mask=mask, cache=cache).logits
        step_ref = ref(input_ids=ids[:, 8:], attention_mask=mask, past_key_values=theirs, use_cache=True).logits
        out["cached_step"] = float((step - step_ref)[real[:, 8:]].abs().max())
        left = mask.clone()
        left[0] = 1  # NOTE: prompts padded on the left only, as generate takes them
        kw = dict(input_ids=ids, attention_mask=left, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_scores=True)
        g, w = model.generate(**kw), ref.generate(**kw)
        out["generate"] = (torch.equal(g.sequences, w.sequences),
                           float(max((a - b).abs().max() for a, b in zip(g.scores, w.scores))))
    return out


def _first_step(folder: str, out_dir: str) -> dict:
    """LoongTrainer's first step (TP2 + SP, learning rate 0) on the left-padded rows: its loss and gradient norm."""
    import datasets
    import transformers

    import loongforge_hf as lf

    ids, mask, labels = _batch()
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                                       "labels": labels.tolist()})
    args = transformers.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=3, max_steps=1,
                                          learning_rate=0.0, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, max_grad_norm=1.0)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **TP2_SP)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    norm = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]).norm()
    return {"loss": (log["loss"], float(loss)), "grad_norm": (log["grad_norm"], float(norm))}


def _grpo(folder: str, out_dir: str) -> dict:
    from tests.integrations._grpo_parity import run_loong, run_trl

    return {"trl": run_trl(folder, out_dir + "/trl", ["grpo_beta0"]),
            "loong": run_loong(folder, out_dir + "/loong", {}, ["grpo_beta0"])}


def _world(folder: str, out_dir: str) -> dict:
    return {"forwards": _forwards(folder), "step": _first_step(folder, out_dir + "/step"),
            "grpo": _grpo(folder, out_dir + "/grpo")}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("opt_mask")
    folder = make_tiny_checkpoint(base / "opt", "opt")
    return run_distributed(_world, 2, str(folder), str(base / "out"), timeout=400), folder


@pytest.mark.parametrize("check", ["logits", "loss", "cached_step"])
def test_left_padded_forward_matches_transformers(world, check):
    """No position_ids, left padding: transformers' positions from the mask in the uncached forward (logits of the
    real tokens, loss) and in a cached step after a left-padded prefill, at TP2 + SP."""
    for rank in world[0]:
        assert rank["forwards"][check] < TOL, rank["forwards"]


def test_left_padded_generate_matches_transformers(world):
    same, diff = world[0][0]["forwards"]["generate"]
    assert same and diff < TOL, (same, diff)


def test_left_padded_training_step_matches_transformers(world):
    """LoongTrainer's batch gets the mask's positions before its checks: the step's loss and gradient norm."""
    step = world[0][0]["step"]
    for ours, theirs in step.values():
        assert abs(ours - theirs) <= TOL * max(1.0, abs(theirs)), step


def test_grpo_matches_trl(world):
    """LoongGRPOTrainer on OPT (no longer refused) at DP2 against trl.GRPOTrainer under DDP: every log, the final
    weights within 1% of how far TRL moved them. NOTE: not the k_proj biases: a shift of every key's score by the same
    q . b_k leaves the softmax as it is, their gradient is 0 up to rounding, which AdamW turns into moves of its own."""
    from tests.integrations._grpo_parity import saved_tensors
    from tests.integrations.test_grpo import _assert_logs_match

    results, folder = world
    ours = [rank["grpo"]["loong"]["grpo_beta0"] for rank in results]
    theirs, initial = results[0]["grpo"]["trl"]["grpo_beta0"], saved_tensors(str(folder))
    _assert_logs_match("grpo_beta0", theirs["logs"], ours[0]["logs"])
    assert ours[1]["logs"] == ours[0]["logs"] and sorted(ours[0]["weights"]) == sorted(theirs["weights"])
    for key, value in theirs["weights"].items():
        moved = float((value - initial[key]).norm())
        if not key.endswith("k_proj.bias"):
            assert moved > 0 and float((ours[0]["weights"][key] - value).norm()) < 1e-2 * moved, key


def test_mask_of_another_length_refused():
    """A cached step's mask must cover the cached and the given tokens (the positions are counted from it): a clear
    error naming attention_mask, before any collective (pure)."""
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.bridges.absolute_positions import mask_positions
    from loongforge_hf.testing.tiny_models import _config

    bridge = get_bridge(_config("opt", architectures=["OPTForCausalLM"]))
    with pytest.raises(ValueError, match="attention_mask has 5 columns; 2 cached"):
        mask_positions(bridge, torch.ones(1, 5), None, past=2, length=4)
