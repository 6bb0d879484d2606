"""push_folder_to_hub / push_to_hub_on_rank0 against the loopback hub of ``fake_hub.py``.

The model folder is a tiny ``LlamaForCausalLM`` written by ``transformers`` in several safetensors shards. The client
runs with Xet off (see ``fake_hub``'s docstring for why), so weights take the git-LFS path and json files the regular
one; no test reaches beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
from huggingface_hub import constants

from loongforge_hf.integrations.hub import HubPushError, model_folder_files, push_folder_to_hub, push_to_hub_on_rank0
from loongforge_hf.parallel.spawn import run_distributed
from tests.integrations.fake_hub import FakeHub

# NOTE: not shaped like an hf_ token, so only the explicit redaction of the token in use can hide it.
TOKEN = "lf-test-secret-5f2c9a7e1d4b"
REDACTED = "<redacted token>"
EXTRA_FILES = {"extra/notes.txt": b"pushed along\n"}
JUNK_FILES = {".DS_Store": b"\0junk", "model.safetensors.tmp": b"partial", "notes.txt~": b"editor backup",
              ".cache/x.lock": b"", "sub/__pycache__/m.pyc": b"\0"}


def _allow_loopback_only() -> None:
    real_connect = socket.socket.connect

    def connect(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1"):
            raise AssertionError(f"a hub test tried to reach {address}")
        return real_connect(self, address)

    socket.socket.connect = connect


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="20KB")
    for name, data in {**EXTRA_FILES, **JUNK_FILES}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def _expected_files(folder: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name not in JUNK_FILES}
    return {**files, **EXTRA_FILES}


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    # huggingface_hub reads these once, at import: patch the constants for this process and the environment for the
    # ranks spawned below, which import it afresh.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    for name, value in {"HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
                        "HF_TOKEN_PATH": str(tmp_path / "no-saved-token")}.items():
        monkeypatch.setenv(name, value)
    for name in ("TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket.socket, "connect", socket.socket.connect)  # restored after the test
    _allow_loopback_only()
    with FakeHub(token=TOKEN) as fake:
        yield fake
    assert fake.unhandled == [], f"the client sent requests the fake hub does not know: {fake.unhandled}"


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")
    return caplog


def test_push_sends_every_file_byte_identical(hub: FakeHub, model_dir: Path, logs, capfd) -> None:
    url = push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, private=True, endpoint=hub.endpoint)

    expected = _expected_files(model_dir)
    assert len([f for f in expected if f.endswith(".safetensors")]) >= 3
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(expected)
    assert hub.files("me/tiny") == expected
    modes = hub.upload_modes("me/tiny")
    assert {f for f, m in modes.items() if m == "lfs"} == {f for f in expected if f.endswith(".safetensors")}
    assert {f for f, m in modes.items() if m == "regular"} == {f for f in expected if not f.endswith(".safetensors")}
    assert url == f"{hub.endpoint}/me/tiny/commit/{hub.commits('me/tiny')[-1]}"
    assert len(hub.commits("me/tiny")) == 2  # the initial commit and one upload
    assert hub.private("me/tiny")

    routes = {route for route, _ in hub.auth_headers}
    assert routes == {"create_repo", "repo_info", "preupload", "lfs_batch", "lfs_upload", "lfs_verify", "commit"}
    assert {auth for route, auth in hub.auth_headers if route != "lfs_upload"} == {f"Bearer {TOKEN}"}
    assert "Pushing" in logs.text and any(r.name.startswith("huggingface_hub") for r in logs.records)
    assert TOKEN not in logs.text
    assert TOKEN not in "".join(capfd.readouterr())


def test_public_by_default_and_unchanged_push_makes_no_commit(hub: FakeHub, model_dir: Path) -> None:
    first = push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, endpoint=hub.endpoint)
    assert not hub.private("me/tiny")
    again = push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, endpoint=hub.endpoint)
    assert again == first
    assert len(hub.commits("me/tiny")) == 2


def test_private_is_not_silently_dropped_on_an_existing_public_repo(hub: FakeHub, model_dir: Path) -> None:
    push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, private=False, endpoint=hub.endpoint)
    with pytest.raises(HubPushError, match="already exists and is public"):
        push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, private=True, endpoint=hub.endpoint,
                           commit_message="second")
    assert len(hub.commits("me/tiny")) == 2


def test_revision_and_pull_request(hub: FakeHub, model_dir: Path) -> None:
    push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, revision="dev", endpoint=hub.endpoint)
    assert hub.files("me/tiny", "dev") == _expected_files(model_dir)
    assert hub.files("me/tiny") == {}

    url = push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, create_pr=True, endpoint=hub.endpoint)
    assert hub.files("me/tiny", "refs/pr/1") == _expected_files(model_dir)
    assert url.endswith(hub.commits("me/tiny", "refs/pr/1")[-1])
    assert hub.files("me/tiny") == {}


def _folder(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


_TWO_SHARD_INDEX = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                              "b": "model-00002-of-00002.safetensors"}})
BAD_FOLDERS = {
    "no config.json": {"model.safetensors": "x"},
    "no weights file": {"config.json": "{}", "README.md": "hi"},
    "no adapter_model.safetensors": {"adapter_config.json": "{}", "model.safetensors": "x"},
    "model-00002-of-00002.safetensors": {"config.json": "{}", "model-00001-of-00002.safetensors": "x",
                                         "model.safetensors.index.json": _TWO_SHARD_INDEX},
    "not a valid shard index": {"config.json": "{}", "model.safetensors": "x", "model.safetensors.index.json": "{"},
}


@pytest.mark.parametrize("message", list(BAD_FOLDERS))
def test_bad_folder_fails_before_any_request(hub: FakeHub, tmp_path: Path, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        push_folder_to_hub(_folder(tmp_path, BAD_FOLDERS[message]), "me/tiny", token=TOKEN, endpoint=hub.endpoint)
    assert hub.requests == []


def test_missing_folder_file_offline_and_bad_arguments_fail_before_any_request(
        hub: FakeHub, tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="no such folder"):
        push_folder_to_hub(tmp_path / "missing", "me/tiny", token=TOKEN, endpoint=hub.endpoint)
    with pytest.raises(NotADirectoryError, match="is a file"):
        push_folder_to_hub(model_dir / "config.json", "me/tiny", token=TOKEN, endpoint=hub.endpoint)
    with pytest.raises(ValueError, match="create_pr=True"):
        push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, create_pr=True, revision="dev", endpoint=hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubPushError, match="offline mode is on"):
        push_folder_to_hub(model_dir, "me/tiny", token=TOKEN, endpoint=hub.endpoint)
    assert hub.requests == []


def test_adapter_folder_is_pushable(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"adapter_config.json": "{}", "adapter_model.safetensors": "x", "README.md": "hi",
                                ".gitignore": "*"})
    assert model_folder_files(folder) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize("route, status", [("create_repo", 500), ("lfs_batch", 403), ("commit", 500)])
@pytest.mark.parametrize("token_from", ["argument", "HF_TOKEN"])
def test_server_failure_is_reported_without_the_token(hub: FakeHub, model_dir: Path, logs, capfd,
                                                      monkeypatch: pytest.MonkeyPatch, route: str, status: int,
                                                      token_from: str) -> None:
    hub.fail(route, status=status)
    if token_from == "HF_TOKEN":
        monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(HubPushError) as info:
        push_folder_to_hub(model_dir, "me/tiny", token=TOKEN if token_from == "argument" else None,
                           endpoint=hub.endpoint)

    error = info.value
    assert f"request had Authorization: Bearer {REDACTED}" in str(error)  # the server did echo it
    assert "me/tiny" in str(error) and str(status) in str(error)
    assert TOKEN not in str(error) and TOKEN not in repr(error) and TOKEN not in str(error.args)
    assert error.__cause__ is None and error.__context__ is None
    assert {auth for r, auth in hub.auth_headers if r != "lfs_upload"} == {f"Bearer {TOKEN}"}
    assert REDACTED in logs.text and TOKEN not in logs.text
    assert TOKEN not in "".join(capfd.readouterr())


def _push_on_every_rank(endpoint: str, folder: str) -> dict:
    import torch.distributed as dist

    _allow_loopback_only()
    dist.init_process_group("gloo")
    url = push_to_hub_on_rank0(folder, "me/tiny", token=TOKEN, endpoint=endpoint)
    try:
        push_to_hub_on_rank0(folder, "me/broken", token=TOKEN, endpoint=endpoint)
        error = None
    except Exception as exc:  # noqa: BLE001 - compared across ranks by the parent
        error = (type(exc).__name__, str(exc))
    dist.barrier()  # the world is still in step after the failure
    return {"url": url, "error": error}


def test_push_on_rank0_gives_every_rank_the_same_outcome(hub: FakeHub, model_dir: Path) -> None:
    hub.fail("commit", status=500, repo_id="me/broken")
    results = run_distributed(_push_on_every_rank, 2, hub.endpoint, str(model_dir), timeout=90)

    assert [r["url"] for r in results] == [f"{hub.endpoint}/me/tiny/commit/{hub.commits('me/tiny')[-1]}"] * 2
    assert hub.files("me/tiny") == _expected_files(model_dir)
    assert len(hub.commits("me/tiny")) == 2  # one push, from rank 0 only
    assert results[0]["error"] == results[1]["error"]
    kind, message = results[0]["error"]
    assert kind == "HubPushError" and "me/broken" in message and REDACTED in message and TOKEN not in message
