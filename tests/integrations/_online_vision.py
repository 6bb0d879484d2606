"""Rank functions for vision GRPO / RLOO: trl.GRPOTrainer / trl.RLOOTrainer on transformers' Qwen2-VL and
LoongGRPOTrainer / LoongRLOOTrainer on the same tiny checkpoint, with the same processor, image dataset
(conversational prompts holding an image of one of two sizes: 2 or 4 image tokens) and config (the text tests'
``grpo_config`` / ``rloo_config``). Each run keeps its logs, the completions each rank scored (as the reward function
saw them) and, on rank 0, the final weights; ``EVAL_SCENARIOS`` TRL's ``evaluate()`` metrics too (but its timings).
"""

from __future__ import annotations

import torch

from ._dpo_vision import _processor
from ._grpo_parity import grpo_config, saved_tensors, thirds
from ._rloo_parity import rloo_config

# the pad token, and the vision tokens (TRL suppresses the image token itself unless generation_kwargs are given)
SUPPRESSED = [0, 200, 201, 202, 203]
SCENARIOS = {
    # GRPO with the KL to the reference (each trainer loads it from the checkpoint), a second pass over each
    # generation, evaluation afterwards (generation, rewards, the reference and the loss in eval mode)
    "vision_grpo": ("grpo", {"loss_type": "grpo", "beta": 0.1, "num_iterations": 2, "max_steps": 2}),
    # RLOO's KL penalty in the reward, a second pass over each generation.
    # NOTE: learning rate 5e-3, as the text test's Qwen3-MoE: AdamW's first step moves a weight that saw almost no
    # gradient by the full rate whatever its sign's rounding, and the second pass's sequence-level ratios (exp of 6
    # tokens' summed log-ratio) show it in the loss at 2e-2 (1.4e-4 relative apart; the first step's 1e-7)
    "vision_rloo": ("rloo", {"beta": 0.1, "num_iterations": 2, "max_steps": 2, "learning_rate": 5e-3}),
}
# LoRA with PEFT's "all-linear" (the vision tower's and merger's linears too), the adapters disabled as the reference
LORA = {"vision_grpo_lora": dict(r=4, lora_alpha=8, target_modules="all-linear")}
SCENARIOS["vision_grpo_lora"] = ("grpo", {"loss_type": "grpo", "beta": 0.1, "num_iterations": 2, "max_steps": 2,
                                          "learning_rate": 2e-2})
EVAL_SCENARIOS = ("vision_grpo",)
NOT_COMPARED = ("step_time", "tokens_per_second", "mfu", "learning_rate", "epoch")
# compared exactly; the other metrics within 1e-4 relative or 1e-6 absolute, as the text tests
EXACT = ("completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
         "completions/mean_terminated_length", "completions/min_terminated_length",
         "completions/max_terminated_length", "num_tokens")


def vision_prompts(n: int = 8, seed: int = 0):
    """``n`` conversational prompts, each an image (28 or 56 pixels high) and one to three words."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        words = "".join(f" tok{int(t)}" for t in torch.randint(4, 200, (int(torch.randint(1, 4, (1,), generator=g)),),
                                                               generator=g))
        image = Image.fromarray(rng.randint(0, 256, (28 * (1 + i % 2), 56, 3), dtype=np.uint8))
        rows.append({"images": [image], "prompt": [{"role": "user", "content": [{"type": "image"},
                                                                                {"type": "text", "text": words}]}]})
    return datasets.Dataset.from_list(rows)


def _config(kind: str, out_dir: str, overrides: dict):
    make = grpo_config if kind == "grpo" else rloo_config
    return make(out_dir, generation_kwargs={"suppress_tokens": SUPPRESSED}, **overrides)


def _run(trainer_cls, model, folder: str, out_dir: str, name: str) -> dict:
    import torch.distributed as dist

    kind, overrides = SCENARIOS[name]
    seen = []

    def reward(completion_ids, **kwargs):
        seen.append([list(ids) for ids in completion_ids])
        return thirds(completion_ids)

    reward.__name__ = "thirds"
    processor = _processor(folder)
    processor.tokenizer.padding_side = "left"  # NOTE: as TRL loads a processor (its image-token types left-padded)
    peft_config = None
    if name in LORA:
        import peft

        peft_config = peft.LoraConfig(**LORA[name])
    trainer = trainer_cls(model=model, reward_funcs=reward, args=_config(kind, out_dir, overrides),
                          peft_config=peft_config, train_dataset=vision_prompts(),
                          eval_dataset=vision_prompts(2, seed=1) if name in EVAL_SCENARIOS else None,
                          processing_class=processor)
    trainer.train()
    trainer.save_model(f"{out_dir}/final")
    result = {"logs": [{k: v for k, v in h.items() if k not in NOT_COMPARED}
                       for h in trainer.state.log_history if "loss" in h], "completions": seen}
    if name in EVAL_SCENARIOS:
        timings = ("_runtime", "_second", "_time")
        result["eval"] = {k: v for k, v in trainer.evaluate().items() if not k.endswith(timings)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        result["weights"] = saved_tensors(f"{out_dir}/final")
    return result


def run_trl_vision(folder: str, out_dir: str, names: list[str]) -> dict:
    """trl.GRPOTrainer / trl.RLOOTrainer on transformers' Qwen2-VL: {scenario: {"logs", "completions", "weights"}}."""
    import transformers
    import trl

    def load():
        return transformers.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)

    return {name: _run(trl.GRPOTrainer if SCENARIOS[name][0] == "grpo" else trl.RLOOTrainer, load(), folder,
                       f"{out_dir}/{name}", name) for name in names}


def run_loong_vision(folder: str, out_dir: str, layout: dict, names: list[str]) -> dict:
    """LoongGRPOTrainer / LoongRLOOTrainer on the image-text model in ``layout``: as ``run_trl_vision``."""
    import loongforge_hf as lf

    def load():
        return lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)

    return {name: _run(lf.LoongGRPOTrainer if SCENARIOS[name][0] == "grpo" else lf.LoongRLOOTrainer, load(), folder,
                       f"{out_dir}/{name}", name) for name in names}


def vision_refusals(folder: str, text_folder: str, out_dir: str) -> list[str]:
    """The messages LoongGRPOTrainer raises for an image dataset with a text model and its tokenizer, and for the
    image-text model's processor with a text model."""
    from transformers import AutoTokenizer

    import loongforge_hf as lf

    from ._grpo_parity import make_dataset

    text = lf.AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    messages = []
    for dataset, processing_class in ((vision_prompts(4), AutoTokenizer.from_pretrained(text_folder)),
                                      (make_dataset(4), _processor(folder))):
        try:
            lf.LoongGRPOTrainer(model=text, reward_funcs=thirds, args=_config("grpo", out_dir, {}),
                                train_dataset=dataset, processing_class=processing_class)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def assert_vision_matches(name: str, refs: list[dict], runs: list[dict], initial: dict) -> None:
    """Each rank's run against its reference (TRL's run, or its rank's under DDP): the completions it scored, every
    logged and evaluation metric, the same logs on every rank; rank 0's final weights: each tensor within 1% of how
    far TRL's training moved it (in norm), as the text tests (LoRA: the adapter folder's tensors, by PEFT's names;
    an adapter counts as moved from zero)."""
    import pytest

    for rank, (ref, run) in enumerate(zip(refs, runs)):
        assert run["completions"] == ref["completions"], (name, rank)
        assert run["logs"] == runs[0]["logs"], (name, rank)
    ref, got = refs[0], runs[0]
    assert len(ref["logs"]) == len(got["logs"]) == SCENARIOS[name][1]["max_steps"]
    assert ("eval" in ref) == ("eval" in got) == (name in EVAL_SCENARIOS)
    for step, (theirs, ours) in enumerate([*zip(ref["logs"], got["logs"]), (ref.get("eval", {}), got.get("eval", {}))]):
        assert sorted(ours) == sorted(theirs), (name, step, set(ours) ^ set(theirs))
        for key, value in theirs.items():
            if key.removeprefix("eval_") in EXACT:
                assert ours[key] == value, (name, step, key)
            else:
                assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, step, key)
    assert sorted(got["weights"]) == sorted(ref["weights"])
    for key, value in ref["weights"].items():
        moved = float((value - initial.get(key, torch.zeros_like(value))).norm())
        assert moved > 0 and float((got["weights"][key] - value).norm()) < 1e-2 * moved, key
