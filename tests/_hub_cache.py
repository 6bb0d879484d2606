"""huggingface_hub's cache layout, built by hand (no network): each file stored once under ``blobs/`` (named by its
sha256), ``snapshots/<commit>/<name>`` a relative symlink to it, ``refs/<branch>`` holding the commit."""

from __future__ import annotations

import hashlib
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT,
                     branch: str = "main") -> Path:
    """The snapshot folder of ``repo_id`` at ``commit`` holding ``files`` ({name: bytes})."""
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():  # NOTE: a name may hold folders ("sub/config.json"), as in a repo
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to("../" * (2 + name.count("/")) + f"blobs/{blob.name}")
    return snapshot


def folder_in_hub_cache(folder: Path, cache: Path, repo_id: str) -> Path:
    """``put_in_hub_cache`` with the files of a local folder (top level only)."""
    return put_in_hub_cache(cache, repo_id, {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()})
