"""Turning what the user passed to ``from_pretrained`` (a folder or a hub id) into a local checkpoint folder.

Choices:
- An existing local folder wins, as in transformers; ``revision`` is then ignored.
- Anything else is a hub id resolved by ``huggingface_hub.snapshot_download`` into the HF cache, downloading only what a
  model needs: configs (``*.json``), safetensors weights, tokenizer and processor files. Pickle weights (``*.bin``,
  ``*.pt``) are fetched only when the caller opts in with ``allow_pickle=True``, and remote code (``*.py``) never.
- ``subfolder`` (transformers' keyword): the checkpoint is that folder of the local folder or of the hub repo (only
  its files are fetched). ``force_download`` re-fetches them from the hub; offline it is an error, as in transformers
  (huggingface_hub refuses ``force_download`` with ``local_files_only``); for a local folder it has no effect.
- Offline mode (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, or ``local_files_only=True``) serves from the cache only.
  ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` are read when this is called, not when huggingface_hub was imported, so a
  script (or a test) that sets them late is still honoured.
- Every failure is a ``CheckpointError`` naming the path or id and saying whether offline mode was on.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError

from .checkpoint_io import CheckpointError

CHECKPOINT_PATTERNS: tuple[str, ...] = (
    "*.json",
    "*.safetensors",
    "tokenizer.*",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
    "merges*",
    "vocab*",
)
PICKLE_PATTERNS: tuple[str, ...] = ("*.bin", "*.pt")

_TRUE = {"1", "ON", "YES", "TRUE"}


def is_offline(local_files_only: bool = False) -> bool:
    """Whether the hub must not be contacted: ``local_files_only`` or the offline environment variables."""
    if local_files_only:
        return True
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var):
            return os.environ[var].upper() in _TRUE
    return bool(constants.HF_HUB_OFFLINE)


def resolve_checkpoint(
    path_or_id: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    allow_pickle: bool = False,
    subfolder: str = "",
    force_download: bool = False,
    tqdm_class=None,
) -> Path:
    """The local folder holding the checkpoint ``path_or_id`` (a folder, or a hub id fetched into the HF cache), or
    its ``subfolder``."""
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        return _subfolder(local.resolve(), subfolder, path_or_id)
    if local.exists():
        raise CheckpointError(f"{str(path_or_id)!r} is a file; a checkpoint is a folder (or a hub id).")

    offline = is_offline(local_files_only)
    if force_download and offline:
        raise CheckpointError(f"{str(path_or_id)!r}: force_download=True needs the hub, but "
                              f"{_mode(offline, local_files_only)}.")
    if cache_dir is None and os.environ.get("HF_HUB_CACHE"):
        cache_dir = os.path.expanduser(os.environ["HF_HUB_CACHE"])
    patterns = list(CHECKPOINT_PATTERNS) + (list(PICKLE_PATTERNS) if allow_pickle else [])
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    try:
        folder = snapshot_download(
            str(path_or_id),
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            token=token,
            allow_patterns=[prefix + p for p in patterns],
            force_download=force_download,
            tqdm_class=tqdm_class,
        )
    except HFValidationError as err:
        raise CheckpointError(
            f"{str(path_or_id)!r} is neither a local folder nor a valid hub id "
            f"({_mode(offline, local_files_only)}): {err}"
        ) from err
    except OSError as err:  # huggingface_hub's not-found, gated, offline and HTTP errors are all OSErrors
        cache = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
        at = f" at revision {revision!r}" if revision else ""
        raise CheckpointError(
            f"{str(path_or_id)!r} is not a local folder, and as a hub id{at} it could not be resolved "
            f"({_mode(offline, local_files_only)}; HF cache {cache}): {type(err).__name__}: {err}"
        ) from err
    return _subfolder(Path(folder).resolve(), subfolder, path_or_id)


def _subfolder(folder: Path, subfolder: str, path_or_id) -> Path:
    if not subfolder:
        return folder
    if Path(subfolder).is_absolute() or ".." in Path(subfolder).parts or not (folder / subfolder).is_dir():
        raise CheckpointError(f"{str(path_or_id)!r} has no subfolder {subfolder!r} (looked in {folder}).")
    return folder / subfolder


def _mode(offline: bool, local_files_only: bool) -> str:
    if not offline:
        return "offline mode off"
    why = "local_files_only=True" if local_files_only else "HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set"
    return f"offline mode on because {why}: only the local HF cache was searched"
