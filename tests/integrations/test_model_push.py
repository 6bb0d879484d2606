"""model.push_to_hub / trainer.push_to_hub on 2 TP ranks against the loopback fake hub: the HF export arrives intact."""

from pathlib import Path

import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from tests.integrations.test_hub_push import TOKEN, _allow_loopback_only, hub  # noqa: F401 - the fixture


def _push(folder: str, out_dir: str, endpoint: str) -> str:
    from huggingface_hub import constants

    import loongforge_hf as lf
    from tests.trainer._train_parity import make_dataset, training_args

    _allow_loopback_only()
    # huggingface_hub read HF_ENDPOINT when this rank imported it; point it at the fake hub the same way.
    constants.ENDPOINT = endpoint
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2)
    model.push_to_hub("me/loong-model", token=TOKEN, private=True)
    args = training_args(out_dir, max_steps=1, hub_model_id="me/loong-trainer", hub_token=TOKEN)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=make_dataset())
    trainer.train()
    url = trainer.push_to_hub()
    # push_to_hub=True: Trainer's automatic uploads, from each checkpoint (hub_strategy="checkpoint": the HF files
    # and the last checkpoint) and from save_model
    args = training_args(out_dir + "/auto", max_steps=2, save_strategy="steps", save_steps=1, push_to_hub=True,
                         hub_model_id="me/loong-auto", hub_token=TOKEN, hub_strategy="checkpoint")
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=make_dataset())
    trainer.train()
    trainer.save_model()
    return url


def test_model_and_trainer_push(hub, tmp_path: Path):  # noqa: F811 - pytest fixture
    import transformers

    src = make_tiny_checkpoint(tmp_path / "src", "qwen3")
    urls = run_distributed(_push, 2, str(src), str(tmp_path / "run"), hub.endpoint, timeout=300)
    assert urls[0] == urls[1] and "me/loong-trainer" in urls[0]
    assert hub.private("me/loong-model")
    for repo in ("me/loong-model", "me/loong-trainer"):
        files = hub.files(repo)
        assert {"config.json", "tokenizer.json"} <= set(files)
        assert any(name.endswith(".safetensors") for name in files)
        assert TOKEN.encode() not in b"".join(files.values())
        local = tmp_path / repo.replace("/", "_")
        for name, data in files.items():
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            (local / name).write_bytes(data)
        pushed = transformers.AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
        if repo == "me/loong-model":  # untrained: the pushed weights are the source's, bit for bit
            ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
            for (n, a), (_, b) in zip(ref.state_dict().items(), pushed.state_dict().items()):
                assert torch.equal(a, b), n
    assert all(header == f"Bearer {TOKEN}" for _, header in hub.auth_headers if header is not None)
    commits = hub.commit_summaries("me/loong-auto")
    # NOTE: step 2's upload is skipped while step 1's runs (Trainer's rule without hub_always_push)
    for message in ("Training in progress, step 1", "Training in progress, step 1, checkpoint", "Model save"):
        assert any(message in c for c in commits), (message, commits)
    files = hub.files("me/loong-auto")
    assert {"config.json", "training_args.bin", "last-checkpoint/config.json",
            "last-checkpoint/trainer_state.json"} <= set(files), sorted(files)
    assert not any(name.startswith("checkpoint-") for name in files)
