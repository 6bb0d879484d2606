"""Rank functions for test_qwen2_5_vl_trl.py: TRL's own image-dataset flow (conversations with images, TRL's vision
collator applying the processor batch by batch) through LoongSFTTrainer and trl.SFTTrainer."""

from __future__ import annotations

import numpy as np
import torch

# renders an image entry of a message as Qwen2.5-VL's vision tokens (the processor expands the image pad)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear")


def conversations(prompt_completion: bool = False):
    """8 user turns with an image (two sizes) and a reply: the dataset formats of TRL's vision-language SFT
    (``messages``, or ``prompt`` / ``completion`` whose loss is on the completion)."""
    import datasets
    from PIL import Image

    rng = np.random.RandomState(0)
    rows = []
    for i in range(8):
        image = Image.fromarray(rng.randint(0, 256, (28 * (1 + i % 2), 56, 3), dtype=np.uint8))
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f" tok{5 + i} tok{6 + i}"}]}
        reply = {"role": "assistant", "content": [{"type": "text", "text": f" tok{30 + i} tok{40 + i} tok{50 + i}"}]}
        turns = {"prompt": [user], "completion": [reply]} if prompt_completion else {"messages": [user, reply]}
        rows.append({**turns, "images": [image]})
    return datasets.Dataset.from_list(rows)


def sft_losses(folder: str, out_dir: str, *, loong: bool, layout: dict | None = None, lora: bool = True,
               max_length: int | None = None, prompt_completion: bool = False) -> dict:
    """3 steps of SFT on ``conversations()`` with the processor as processing_class, evaluating on 4 of them after
    each step, through LoongSFTTrainer (in ``layout``) or trl.SFTTrainer on transformers' model: the logged losses
    and eval losses."""
    import peft
    import transformers
    import trl
    from transformers import AutoTokenizer

    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_vl import make_processor

    processor = make_processor(AutoTokenizer.from_pretrained(folder))
    processor.chat_template = CHAT_TEMPLATE
    args = trl.SFTConfig(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=3,
                         learning_rate=2e-2, lr_scheduler_type="constant", logging_steps=1, seed=0, report_to=[],
                         save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, max_length=max_length,
                         eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2)
    evaluation = conversations(prompt_completion).select(range(4))
    peft_config = peft.LoraConfig(**LORA) if lora else None
    if loong:
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **(layout or {}))
        trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=conversations(prompt_completion),
                                     eval_dataset=evaluation, processing_class=processor, peft_config=peft_config)
    else:
        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=conversations(prompt_completion),
                                 eval_dataset=evaluation, processing_class=processor, peft_config=peft_config)
    trainer.train()
    return {key: [h[key] for h in trainer.state.log_history if key in h] for key in ("loss", "eval_loss")}


def one_rank(folder: str, out_dir: str) -> dict:
    return {f"{who}/{kind}": sft_losses(folder, f"{out_dir}/{who}-{kind}", loong=who == "loong", lora=kind != "full",
                                        prompt_completion=kind == "prompt_completion")
            for who in ("trl", "loong") for kind in ("full", "lora", "prompt_completion")}


TWO_RANK_LAYOUTS = {
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "tp2_split_tower": {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2},
    "cp2": {"context_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},  # NOTE: batches of one length: TRL's collator pads to max_length
}


# prompt-completion data: TRL's collator refuses pad_to_multiple_of, the batch is padded after it
PROMPT_COMPLETION_LAYOUTS = ("tp2_sp", "cp2")


def two_ranks(folder: str, out_dir: str) -> dict:
    out = {name: sft_losses(folder, f"{out_dir}/{name}", loong=True, layout=layout,
                            max_length=64 if name == "pp2" else None)
           for name, layout in TWO_RANK_LAYOUTS.items()}
    out.update({f"prompt_completion/{name}": sft_losses(folder, f"{out_dir}/pc-{name}", loong=True,
                                                        layout=TWO_RANK_LAYOUTS[name], prompt_completion=True)
                for name in PROMPT_COMPLETION_LAYOUTS})
    # NOTE: last: their trainers fail
    out["cut_image"] = cut_image_everywhere(folder, f"{out_dir}/cut-image")
    out["cut_image/messages"] = cut_image_everywhere(folder, f"{out_dir}/cut-image-messages", messages=True)
    return out


def _words_before_image(words: int, n: int = 4, messages: bool = False):
    """``n`` prompt / completion rows (``messages``: conversations) whose prompt holds ``words`` words, then a 56x56
    image (4 placeholder tokens)."""
    import datasets
    from PIL import Image

    rng = np.random.RandomState(0)
    rows = []
    for i in range(n):
        user = {"role": "user", "content": [{"type": "text", "text": f" tok{5 + i}" * words}, {"type": "image"}]}
        reply = {"role": "assistant", "content": [{"type": "text", "text": f" tok{30 + i} tok{40 + i}"}]}
        turns = {"messages": [user, reply]} if messages else {"prompt": [user], "completion": [reply]}
        rows.append({**turns, "images": [Image.fromarray(rng.randint(0, 256, (56, 56, 3), dtype=np.uint8))]})
    return datasets.Dataset.from_list(rows)


def cut_image_everywhere(folder: str, out_dir: str, messages: bool = False) -> dict:
    """DP2 with max_length=18: rank 0's prompts hold 2 words before the image, rank 1's 12, so TRL's vision collator
    (which truncates input_ids, not the images) keeps 2 of each image's 4 placeholders on rank 1 only (``messages``:
    conversations, where the processor itself raises on rank 1). Evaluation, then training: each one's error on this
    rank, (type, message), or None."""
    import torch.distributed as dist
    import trl
    from transformers import AutoTokenizer

    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_vl import make_processor

    processor = make_processor(AutoTokenizer.from_pretrained(folder))
    processor.chat_template = CHAT_TEMPLATE
    args = trl.SFTConfig(output_dir=out_dir, per_device_train_batch_size=2, max_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, max_length=18,
                         per_device_eval_batch_size=2)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    data = _words_before_image(12 if dist.get_rank() == 1 else 2, messages=messages)
    trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                                 processing_class=processor)
    out = {}
    for name, run in (("evaluate", trainer.evaluate), ("train", trainer.train)):
        try:
            run()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[name] = (type(e).__name__, str(e))
    return out
