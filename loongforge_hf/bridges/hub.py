"""Turning what the user passed to ``from_pretrained`` (a folder or a hub id) into a local checkpoint folder.

Choices:
- An existing local folder wins, as in transformers; ``revision`` is then ignored.
- Anything else is a hub id resolved by ``huggingface_hub.snapshot_download`` into the HF cache, downloading only what a
  model needs: configs (``*.json``), safetensors weights, tokenizer and processor files. Pickle weights (``*.bin``,
  ``*.pt``) are fetched only when the caller opts in with ``allow_pickle=True``, and remote code (``*.py``) never.
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
) -> Path:
    """The local folder holding the checkpoint ``path_or_id`` (a folder, or a hub id fetched into the HF cache)."""
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists():
        raise CheckpointError(f"{str(path_or_id)!r} is a file; a checkpoint is a folder (or a hub id).")

    offline = is_offline(local_files_only)
    if cache_dir is None and os.environ.get("HF_HUB_CACHE"):
        cache_dir = os.path.expanduser(os.environ["HF_HUB_CACHE"])
    patterns = list(CHECKPOINT_PATTERNS) + (list(PICKLE_PATTERNS) if allow_pickle else [])
    try:
        folder = snapshot_download(
            str(path_or_id),
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            token=token,
            allow_patterns=patterns,
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
    return Path(folder).resolve()


def _mode(offline: bool, local_files_only: bool) -> str:
    if not offline:
        return "offline mode off"
    why = "local_files_only=True" if local_files_only else "HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set"
    return f"offline mode on because {why}: only the local HF cache was searched"
