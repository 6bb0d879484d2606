"""Rank functions for vision DPO: trl.DPOTrainer on transformers' Qwen2-VL and LoongDPOTrainer on the same tiny
checkpoint, with the same processor, image dataset (conversational prompts holding an image, TRL's
``DataCollatorForVisionPreference`` applying the processor batch by batch) and DPOConfig (``_dpo_parity.dpo_config``).
Scenarios as ``_dpo_parity.SCENARIOS``: (DPOConfig overrides, LoraConfig kwargs or None, ref_model passed).
"""

from __future__ import annotations

import torch

from ._dpo_parity import _eval_logs, _logs, dpo_config, saved_tensors

# renders an image entry of a message as Qwen2-VL's vision tokens (the processor expands the image pad)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
# Gemma 3's processor expands its begin-of-image token into the image's soft tokens
GEMMA3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")

VISION_SCENARIOS = {
    # no ref_model: each trainer loads the policy's checkpoint again (TRL as transformers', here with its layout)
    "vision_full": ({"learning_rate": 2e-3, "max_length": 32}, None, False),
    # LoRA on the language model's and the vision tower's attention (the disabled adapters are the reference)
    "vision_lora": ({"learning_rate": 3e-2, "max_length": 32, "eval_strategy": "steps", "eval_steps": 2,
                     "per_device_eval_batch_size": 2},
                    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "qkv"]), False),
}
# the same with padding_free=True: TRL 1.16 warns and pads, as LoongDPOTrainer does with images (nothing packed)
VISION_SCENARIOS["vision_padding_free"] = ({**VISION_SCENARIOS["vision_lora"][0], "padding_free": True},
                                           *VISION_SCENARIOS["vision_lora"][1:])


def vision_dataset(n: int = 16, seed: int = 0):
    """``n`` conversational preference rows whose prompt holds an image (two sizes: 2 or 4 image tokens) and a few
    words, the completions 2 to 5 words."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    g = torch.Generator().manual_seed(seed)

    def words(low: int, high: int) -> str:
        n = int(torch.randint(low, high, (1,), generator=g))
        return "".join(f" tok{int(i)}" for i in torch.randint(4, 200, (n,), generator=g))

    rows = []
    for i in range(n):
        image = Image.fromarray(rng.randint(0, 256, (28 * (1 + i % 2), 56, 3), dtype=np.uint8))
        user = [{"type": "image"}, {"type": "text", "text": words(1, 4)}]
        rows.append({"images": [image], "prompt": [{"role": "user", "content": user}],
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": words(2, 6)}]}],
                     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": words(2, 6)}]}]})
    return datasets.Dataset.from_list(rows)


def _processor(folder: str):
    from loongforge_hf.testing.tiny_vl import processor_for

    processor = processor_for(folder)
    gemma3 = type(processor).__name__ == "Gemma3Processor"
    processor.chat_template = GEMMA3_CHAT_TEMPLATE if gemma3 else CHAT_TEMPLATE
    return processor


def _eval_dataset(overrides: dict):
    return vision_dataset(4, seed=3) if overrides.get("eval_strategy") else None


def run_trl_vision(folder: str, out_dir: str, names: list[str], scenarios: dict = VISION_SCENARIOS) -> dict:
    """trl.DPOTrainer (+ PEFT) on transformers' image-text model (Qwen2-VL, Gemma 3): {scenario of ``scenarios``:
    {"logs", "eval_logs", "weights"}}."""
    import peft
    import transformers
    import trl

    def load():
        return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)

    out = {}
    for name in names:
        overrides, lora, with_ref = scenarios[name]
        trainer = trl.DPOTrainer(model=load(), ref_model=load() if with_ref else None,
                                 args=dpo_config(f"{out_dir}/{name}", **overrides), train_dataset=vision_dataset(),
                                 eval_dataset=_eval_dataset(overrides), processing_class=_processor(folder),
                                 peft_config=peft.LoraConfig(**lora) if lora else None)
        trainer.train()
        if lora:
            weights = {k: v.detach().cpu().clone() for k, v in peft.get_peft_model_state_dict(trainer.model).items()}
        else:
            trainer.model.save_pretrained(f"{out_dir}/{name}/final")
            weights = saved_tensors(f"{out_dir}/{name}/final")
        out[name] = {"logs": _logs(trainer), "eval_logs": _eval_logs(trainer), "weights": weights}
    return out


def run_loong_vision(folder: str, out_dir: str, layout: dict, names: list[str],
                     scenarios: dict = VISION_SCENARIOS) -> dict:
    """LoongDPOTrainer on the image-text model in ``layout``: {scenario of ``scenarios``: {"logs", "eval_logs",
    "weights" (rank 0)}}."""
    import peft
    import torch.distributed as dist

    import loongforge_hf as lf

    def load():
        return lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)

    out = {}
    for name in names:
        overrides, lora, with_ref = scenarios[name]
        trainer = lf.LoongDPOTrainer(model=load(), ref_model=load() if with_ref else None,
                                     args=dpo_config(f"{out_dir}/{name}", **overrides), train_dataset=vision_dataset(),
                                     eval_dataset=_eval_dataset(overrides), processing_class=_processor(folder),
                                     peft_config=peft.LoraConfig(**lora) if lora else None)
        trainer.train()
        trainer.save_model(f"{out_dir}/{name}/final")
        result = {"logs": _logs(trainer), "eval_logs": _eval_logs(trainer)}
        if dist.get_rank() == 0:
            result["weights"] = saved_tensors(f"{out_dir}/{name}/final")
        out[name] = result
    return out


# what stays refused with an image dataset: (DPOConfig overrides, the field the message names)
VISION_REFUSED = (({"precompute_ref_log_probs": True}, "precompute_ref_log_probs"),
                  ({"truncation_mode": "keep_end"}, "truncation_mode"),
                  ({"pad_to_multiple_of": 8}, "pad_to_multiple_of"))


def vision_refusals(folder: str, text_folder: str, out_dir: str) -> list[str]:
    """The messages LoongDPOTrainer raises for an image dataset with ``VISION_REFUSED``'s settings, then with a text
    model (and its tokenizer)."""
    from transformers import AutoTokenizer

    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    text = lf.AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    cases = [(model, _processor(folder), overrides) for overrides, _ in VISION_REFUSED]
    cases.append((text, AutoTokenizer.from_pretrained(text_folder), {}))
    messages = []
    for policy, processing_class, overrides in cases:
        try:
            lf.LoongDPOTrainer(model=policy, args=dpo_config(out_dir, **overrides), train_dataset=vision_dataset(4),
                               processing_class=processing_class)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages
