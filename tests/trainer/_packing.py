"""Rank functions for packing: packed vs unpacked documents give the same loss."""

import torch


def docs(n=12, seed=5, vocab=203):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 14, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (L,), generator=g).tolist() for L in lengths]


def forward_packed_vs_unpacked(folder: str, layout: dict):
    from transformers import DataCollatorWithFlattening

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    ds = docs(4)
    packed = DataCollatorWithFlattening()([{"input_ids": d} for d in ds])
    with torch.no_grad():
        out = model(**packed)
        total, count = 0.0, 0
        for d in ds:
            ids = torch.tensor([d])
            result = model(input_ids=ids, labels=ids)
            assert result.logits.shape[:2] == ids.shape, (result.logits.shape, ids.shape)
            total += result.loss.item() * (len(d) - 1)
            count += len(d) - 1
    return out.loss.item(), total / count


class PadCollator:
    """Right padding with labels -100 on padding (the unpacked reference for packing)."""

    def __call__(self, features):
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), longest, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = ids[i, :n]
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train_packed_or_padded(folder: str, out_dir: str, layout: dict, packed: bool):
    import datasets
    import transformers
    from transformers import DataCollatorWithFlattening

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    ds = datasets.Dataset.from_dict({"input_ids": docs(12)})
    args = transformers.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=3, max_steps=3,
                                          learning_rate=5e-3, logging_steps=1, seed=0, report_to=[],
                                          save_strategy="no", use_cpu=True, disable_tqdm=True,
                                          remove_unused_columns=False)
    collator = DataCollatorWithFlattening() if packed else PadCollator()
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
