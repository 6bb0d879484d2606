"""A training script without an ``if __name__ == "__main__":`` guard, as the README's quickstart is written, saves its
checkpoints: megatron-core's checkpoint writer used to start a spawn-context process that ran the script again (a
second model load: a hang under torchrun, an error on one process). The save forks nothing either: a fork of the
training process copies the locks its other threads hold (a hub upload's, a callback's) into a child that can then
wait on them forever."""

import os
import subprocess
import sys
import textwrap

from loongforge_hf.testing import make_tiny_checkpoint

SCRIPT = """
import os
os.register_at_fork(before=lambda: print("FORKING", flush=True))
import datasets, transformers
import loongforge_hf as lf

model = lf.AutoModelForCausalLM.from_pretrained({source!r})
tokenizer = transformers.AutoTokenizer.from_pretrained({source!r})
ds = datasets.Dataset.from_dict({{"input_ids": [[4 + (i + j) % 16 for j in range(16)] for i in range(8)]}})
trainer = lf.LoongTrainer(
    model=model, processing_class=tokenizer, train_dataset=ds,
    args=transformers.TrainingArguments(output_dir={out!r}, max_steps=1, save_steps=1, per_device_train_batch_size=2,
                                        report_to="none", use_cpu=True, disable_tqdm=True),
    data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
trainer.train()
print("TRAINED")
"""


def test_unguarded_script_saves_checkpoint(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "source", "qwen3")
    out = tmp_path / "out"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(source=str(source), out=str(out))), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOONGFORGE_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count("TRAINED") == 1
    assert "FORKING" not in proc.stdout, "the checkpoint save forked the training process"
    assert (out / "checkpoint-1" / "megatron" / "metadata.json").is_file()
