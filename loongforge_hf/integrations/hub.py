"""Uploading an exported Hugging Face model folder to the Hub.

Choices:
- The upload is ``huggingface_hub``'s own: ``HfApi.create_repo(exist_ok=True)`` then ``HfApi.upload_folder``, so the
  Hub sees what ``transformers``' ``push_to_hub`` sends (Xet when ``hf_xet`` is installed, git-LFS otherwise).
- The folder is checked before any network call: it must exist and be a model folder (``config.json`` and a weights
  file) or a PEFT adapter folder (``adapter_config.json`` and an ``adapter_model.*`` file), and every shard named by a
  ``*.index.json`` must be there. Offline mode (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``) fails here too.
- Exactly the folder's files are sent, minus hidden paths (any component starting with ``.``), ``__pycache__`` and
  temporary files (``*.tmp``, ``*.part``, ``*~``, ...): the list is computed here and passed as escaped
  ``allow_patterns``.
- ``private`` only applies when the repo is created, as on the Hub; asking for ``private=True`` on an existing public
  repo is refused before anything is uploaded. ``revision`` names a branch, created from main when missing.
- The token never leaves in text: any failure after the checks becomes a ``HubPushError`` whose message has every
  known token (the one passed, the one huggingface_hub would fall back to, anything shaped like ``hf_...``) replaced,
  raised without a chained cause (huggingface_hub's errors hold the request and its Authorization header).
- ``push_to_hub_on_rank0`` is for code that runs on every rank: rank 0 pushes and broadcasts the outcome, so every rank
  returns the same URL or raises the same error, and no rank waits forever when rank 0 fails.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from huggingface_hub import HfApi, constants, get_token

logger = logging.getLogger(__name__)

DEFAULT_COMMIT_MESSAGE = "Upload model with loongforge-hf"
WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin")
TEMPORARY_SUFFIXES: tuple[str, ...] = (".tmp", ".temp", ".part", ".partial", ".incomplete", ".lock", ".swp", "~")

_REDACTED = "<redacted token>"
_HF_TOKEN_SHAPE = re.compile(r"hf_[A-Za-z0-9]{20,}")
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubPushError(RuntimeError):
    """The push failed after the folder was checked; the message names folder, repo and endpoint, never a token."""


def push_folder_to_hub(folder: str | os.PathLike, repo_id: str, *, token: str | None = None,
                       private: bool | None = None, revision: str | None = None,
                       commit_message: str = DEFAULT_COMMIT_MESSAGE, create_pr: bool = False,
                       endpoint: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload the model folder ``folder`` to it in one go; return the commit URL.

    ``token`` defaults to huggingface_hub's (``HF_TOKEN`` or the saved login); ``endpoint`` to ``HF_ENDPOINT``.
    """
    folder = Path(folder)
    files = model_folder_files(folder)
    if create_pr and revision not in (None, constants.DEFAULT_REVISION):
        raise ValueError(f"create_pr=True opens a pull request against main; it cannot be combined with "
                         f"revision={revision!r}.")
    if _offline():
        raise HubPushError(f"Cannot push {folder} to {repo_id}: offline mode is on (HF_HUB_OFFLINE or "
                           "TRANSFORMERS_OFFLINE). Unset it before huggingface_hub is imported to push.")

    secrets = [t for t in (token, _fallback_token(token)) if t]
    api = HfApi(endpoint=endpoint, token=token, library_name="loongforge-hf")
    size = sum((folder / f).stat().st_size for f in files)
    logger.info("Pushing %d files (%.1f MB) from %s to %s at %s.", len(files), size / 1e6, folder, repo_id,
                api.endpoint)
    logger.debug("Files to push: %s", ", ".join(files))
    failure: Exception | None = None
    try:
        _create_repo(api, repo_id, private=private, revision=revision)
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                                 commit_message=commit_message, create_pr=create_pr,
                                 allow_patterns=[_escape_pattern(f) for f in files])
    except Exception as exc:  # noqa: BLE001 - every failure is reported below, redacted
        failure = exc
    if failure is not None:
        # NOTE: raised outside the except block so that the original error (whose request carries the Authorization
        # header) is neither the cause nor the context of the one the caller sees.
        detail = redact(f"{type(failure).__name__}: {failure}", secrets)
        message = f"Pushing {folder} to {repo_id} at {api.endpoint} failed: {detail}"
        logger.warning(message)
        raise HubPushError(message)
    logger.info("Pushed %s to %s: %s", folder, repo_id, info.commit_url)
    return info.commit_url


def push_to_hub_on_rank0(folder: str | os.PathLike, repo_id: str, *,
                         timeout: datetime.timedelta = datetime.timedelta(hours=4), **kwargs: Any) -> str:
    """``push_folder_to_hub`` on global rank 0; every rank returns its result or raises its error.

    Call it on every rank. Without an initialised ``torch.distributed`` this is ``push_folder_to_hub``. ``timeout``
    bounds how long the other ranks wait for rank 0's upload.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return push_folder_to_hub(folder, repo_id, **kwargs)
    # NOTE: the upload can outlast the default group's collective timeout (NCCL's watchdog kills a rank that waits
    # longer), so the ranks wait for rank 0 on a gloo group of their own, with a timeout sized for uploads.
    group = dist.new_group(backend="gloo", timeout=timeout)
    local_error: Exception | None = None
    outcome: list[Any] = [None]
    try:
        if dist.get_rank() == 0:
            try:
                outcome[0] = ("ok", push_folder_to_hub(folder, repo_id, **kwargs))
            except Exception as exc:  # noqa: BLE001 - every rank must learn about it
                local_error = exc
                outcome[0] = ("error",) + _portable_error(exc, kwargs.get("token"))
        dist.broadcast_object_list(outcome, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    if local_error is not None:
        raise local_error
    status, *rest = outcome[0]
    if status == "ok":
        return rest[0]
    kind, message = rest
    raise _PORTABLE_ERRORS[kind](message)


def model_folder_files(folder: Path) -> list[str]:
    """The files of ``folder`` a push sends (POSIX paths relative to it, sorted), after checking it is a model folder.

    Raises ``FileNotFoundError``/``NotADirectoryError`` for a missing folder and ``ValueError`` naming what is missing.
    """
    if not folder.exists():
        raise FileNotFoundError(f"Cannot push {folder}: no such folder.")
    if not folder.is_dir():
        raise NotADirectoryError(f"Cannot push {folder}: it is a file, not a model folder.")
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and _is_pushed(PurePosixPath(p.relative_to(folder).as_posix())))
    top = {f for f in files if "/" not in f}
    if "adapter_config.json" in top:
        weights = [f for f in top if f.startswith("adapter_model") and f.endswith(WEIGHT_SUFFIXES)]
        if not weights:
            raise ValueError(f"Cannot push {folder}: adapter_config.json is there but no adapter_model.safetensors "
                             "(or adapter_model.bin) weights file.")
    elif "config.json" in top:
        weights = [f for f in top if f.endswith(WEIGHT_SUFFIXES)]
        if not weights:
            raise ValueError(f"Cannot push {folder}: config.json is there but no weights file "
                             f"(*{', *'.join(WEIGHT_SUFFIXES)}).")
    else:
        raise ValueError(f"Cannot push {folder}: not a Hugging Face model folder (no config.json, nor "
                         "adapter_config.json for a PEFT adapter).")
    for index in sorted(f for f in top if f.endswith(".index.json")):
        _check_index(folder, index, top)
    return files


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` and anything shaped like a Hugging Face token replaced."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, _REDACTED)
    return _HF_TOKEN_SHAPE.sub(_REDACTED, text)


def _is_pushed(path: PurePosixPath) -> bool:
    hidden = any(part.startswith(".") or part == "__pycache__" for part in path.parts)
    return not hidden and not path.name.endswith(TEMPORARY_SUFFIXES)


def _check_index(folder: Path, index: str, top: set[str]) -> None:
    try:
        weight_map = json.loads((folder / index).read_text())["weight_map"]
        shards = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"Cannot push {folder}: {index} is not a valid shard index ({exc!r}).") from None
    missing = sorted(shards - top)
    if missing:
        raise ValueError(f"Cannot push {folder}: {index} names shards that are not in the folder: "
                         f"{', '.join(missing)}.")


def _escape_pattern(path: str) -> str:
    """An fnmatch pattern matching exactly ``path``."""
    return re.sub(r"([\[\]*?])", r"[\1]", path)


def _offline() -> bool:
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or env.upper() in _TRUE


def _fallback_token(token: str | None) -> str | None:
    """The token huggingface_hub sends when none is passed, so that it can be redacted too."""
    if token is not None:
        return None
    try:
        return get_token()
    except Exception:  # noqa: BLE001 - a broken login only means there is nothing more to redact
        return None


def _create_repo(api: HfApi, repo_id: str, *, private: bool | None, revision: str | None) -> None:
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if private:
        # NOTE: create_repo(exist_ok=True) leaves an existing repo's visibility as it is; uploading a model that was
        # asked to be private into a public repo would publish it.
        if not api.repo_info(repo_id, repo_type="model").private:
            raise PermissionError(f"{repo_id} already exists and is public, but private=True was asked; nothing was "
                                  "uploaded (change the repo's visibility first, or pass private=None).")
    if revision is not None and revision != constants.DEFAULT_REVISION and not revision.startswith("refs/pr/"):
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)


_PORTABLE_ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    HubPushError, FileNotFoundError, NotADirectoryError, ValueError, TypeError)}


def _portable_error(exc: Exception, token: str | None) -> tuple[str, str]:
    """(class name, message) for rebuilding ``exc`` on another rank; unknown classes become ``HubPushError``."""
    secrets = [token, _fallback_token(token)]
    if type(exc).__name__ in _PORTABLE_ERRORS and type(exc) is _PORTABLE_ERRORS[type(exc).__name__]:
        return type(exc).__name__, redact(str(exc), secrets)
    return HubPushError.__name__, redact(f"{type(exc).__name__}: {exc}", secrets)
