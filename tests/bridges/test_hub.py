import json

import pytest
import torch
from safetensors.torch import save_file

from loongforge_hf.bridges import hub
from loongforge_hf.bridges.checkpoint_io import CheckpointError, CheckpointReader
from loongforge_hf.bridges.hub import resolve_checkpoint

from .._hub_cache import COMMIT, put_in_hub_cache


def make_hub_cache(cache, repo_id="tiny-org/tiny-model", commit=COMMIT, branch="main"):
    """A two-shard safetensors checkpoint in huggingface_hub's cache layout."""
    staging = cache / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.arange(6.0).reshape(2, 3)}, str(staging / "s1"), metadata={"format": "pt"})
    save_file({"b": torch.ones(4)}, str(staging / "s2"), metadata={"format": "pt"})
    files = {
        "config.json": json.dumps({"model_type": "llama"}).encode(),
        "model-00001-of-00002.safetensors": (staging / "s1").read_bytes(),
        "model-00002-of-00002.safetensors": (staging / "s2").read_bytes(),
        "model.safetensors.index.json": json.dumps({"metadata": {"total_size": 40}, "weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}).encode(),
    }
    return put_in_hub_cache(cache, repo_id, files, commit, branch)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


def test_local_folder_resolves_to_itself(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    assert resolve_checkpoint(tmp_path / "ckpt") == (tmp_path / "ckpt").resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("ckpt") == (tmp_path / "ckpt").resolve()
    assert resolve_checkpoint("./ckpt", revision="ignored-for-folders").is_absolute()


def test_a_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_checkpoint(tmp_path / "model.safetensors")


def test_hub_id_from_cache_dir_offline(tmp_path, offline):
    snapshot = make_hub_cache(tmp_path / "hub")
    folder = resolve_checkpoint("tiny-org/tiny-model", cache_dir=tmp_path / "hub")
    assert folder == snapshot.resolve()
    assert resolve_checkpoint("tiny-org/tiny-model", cache_dir=tmp_path / "hub", revision=COMMIT) == folder
    # the shards are symlinks into the repo's blobs/ folder: the reader must accept them
    with CheckpointReader(folder) as reader:
        assert torch.equal(reader.get("a"), torch.arange(6.0).reshape(2, 3))
        assert torch.equal(reader.get_slice("b", dim=0, start=1, stop=3), torch.ones(2))


def test_hub_id_from_hf_hub_cache_env(tmp_path, offline, monkeypatch):
    snapshot = make_hub_cache(tmp_path / "env-cache")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "env-cache"))
    assert resolve_checkpoint("tiny-org/tiny-model") == snapshot.resolve()


def test_local_files_only_without_offline_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    snapshot = make_hub_cache(tmp_path / "hub")
    assert resolve_checkpoint("tiny-org/tiny-model", cache_dir=tmp_path / "hub", local_files_only=True) \
        == snapshot.resolve()
    with pytest.raises(CheckpointError, match=r"'tiny-org/absent'.*offline mode on because local_files_only=True"):
        resolve_checkpoint("tiny-org/absent", cache_dir=tmp_path / "hub", local_files_only=True)


def test_unknown_id_offline_names_id_and_mode(tmp_path, offline):
    make_hub_cache(tmp_path / "hub")
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("tiny-org/other-model", cache_dir=tmp_path / "hub")
    message = str(err.value)
    assert "'tiny-org/other-model' is not a local folder" in message
    assert "offline mode on" in message and f"HF cache {tmp_path / 'hub'}" in message
    with pytest.raises(CheckpointError, match=r"at revision 'v2'.*offline mode on"):
        resolve_checkpoint("tiny-org/tiny-model", cache_dir=tmp_path / "hub", revision="v2")


def test_missing_path_that_is_no_hub_id(tmp_path, offline):
    missing = tmp_path / "no" / "such" / "folder"
    expected = r"neither a local folder nor a valid hub id \(offline mode on because HF_HUB_OFFLINE"
    with pytest.raises(CheckpointError, match=expected):
        resolve_checkpoint(missing)
    with pytest.raises(CheckpointError, match=r"'\./typo--dir' is neither a local folder nor a valid hub id"):
        resolve_checkpoint("./typo--dir")


def test_download_request_patterns_and_offline_flag(tmp_path, monkeypatch):
    """What is asked of huggingface_hub: weights, configs, tokenizer files; pickle only on request; never code."""
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve_checkpoint("org/model", revision="main", token="t") == tmp_path.resolve()
    repo_id, kwargs = calls[-1]
    assert repo_id == "org/model" and kwargs["revision"] == "main" and kwargs["token"] == "t"
    assert kwargs["local_files_only"] is False and kwargs["cache_dir"] is None
    patterns = kwargs["allow_patterns"]
    for wanted in ("*.json", "*.safetensors", "tokenizer.*", "*.model", "*.txt", "*.jinja"):
        assert wanted in patterns
    assert not any(p.endswith((".bin", ".pt", ".py")) for p in patterns)
    resolve_checkpoint("org/model", allow_pickle=True)
    assert {"*.bin", "*.pt"} <= set(calls[-1][1]["allow_patterns"])
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    resolve_checkpoint("org/model")
    assert calls[-1][1]["local_files_only"] is True
