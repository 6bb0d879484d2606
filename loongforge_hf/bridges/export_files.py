"""The files of an HF export besides the weights, and what an existing destination keeps.

Choices:
- config.json is the source's file unchanged when the model's config is as loaded and the tensors are written in the
  dtype it names; otherwise the source's JSON with the fields the model's config changed since
  (``changed_config_fields``) and the dtype of the tensors written, as transformers' save_pretrained writes
  ``model.config``. generation_config.json: the source's file, or the JSON of the generation config the model hands
  over (once it differs from the source's, or when the source has none: transformers writes one derived from the
  config then).
- Tokenizer / processor files and extra chat templates are copied from the source folder unless the destination
  already holds its own (a tokenizer saved there first wins, as transformers' model.save_pretrained never writes
  tokenizer files) or the caller hands its own (``side_files_dir``: LoongTrainer's processing class, saved with the
  weights in one swap).
- An existing destination keeps its other files (``CheckpointWriter(carry_over=keeps_old_entry)``): only the old
  weight shards and index are dropped, and the folder is still swapped in at once.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from loongforge_hf.bridges.fp8_checkpoint import drop_dequantized_quantization

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
              "additional_chat_templates")
# the weight files of a folder that a new export supersedes (transformers' and older pickle names)
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")
# config fields that record how the model was loaded, not what it is
_LOAD_FIELDS = ("dtype", "torch_dtype", "_name_or_path", "transformers_version")
_MISSING = object()


def keeps_old_entry(name: str) -> bool:
    """Whether an export into an existing folder keeps that folder's ``name`` (its old weights go)."""
    return _WEIGHT_FILE.fullmatch(name) is None


def check_export_dtype(dtype) -> None:
    """``save_pretrained(dtype=)``: a torch.dtype or None."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"save_pretrained: dtype must be a torch.dtype or None, got {dtype!r}.")


def changed_config_fields(config, loaded: dict | None) -> dict:
    """The fields of ``config`` (a transformers config) that differ from ``loaded`` (its ``to_dict()`` at load)."""
    if loaded is None:
        return {}
    return {k: v for k, v in config.to_dict().items() if k not in _LOAD_FIELDS and loaded.get(k, _MISSING) != v}


def config_text(source: Path | None, hf_config, dtype: torch.dtype, changes: dict | None = None) -> str:
    """config.json for tensors written in ``dtype``: the source's file verbatim when nothing differs, else its JSON
    with the ``changes`` (``changed_config_fields``) and the dtype."""
    path = source / "config.json" if source is not None else None
    text = path.read_text() if path is not None and path.is_file() else None
    data = json.loads(text) if text is not None else hf_config.to_dict()
    name = str(dtype).removeprefix("torch.")
    if text is not None and not changes and (data.get("dtype") or data.get("torch_dtype")) == name \
            and "quantization_config" not in data:
        return text
    data.update(changes or {})
    drop_dequantized_quantization(data)  # NOTE: the weights written are dequantised (fp8_checkpoint.py)
    data["dtype"] = name
    if "torch_dtype" in data:
        data["torch_dtype"] = name
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_side_files(writer, source: Path | None, hf_config, dtype: torch.dtype, config_changes: dict | None,
                     generation_config, side_files_dir: str | os.PathLike | None = None) -> None:
    """config.json, generation_config.json (``generation_config``'s JSON, or the source's file when it is None), the
    files of ``side_files_dir`` and the source's tokenizer / processor files that neither it nor the destination
    holds already, through ``writer``."""
    writer.write_text("config.json", config_text(source, hf_config, dtype, config_changes))
    if generation_config is not None:
        writer.write_text("generation_config.json", generation_config.to_json_string(use_diff=True))
    elif source is not None and (source / "generation_config.json").is_file():
        writer.copy_file("generation_config.json", source / "generation_config.json")
    if side_files_dir is not None:
        side_files_dir = Path(side_files_dir)
        copy_folder_into(writer, side_files_dir)
    if source is None:
        return
    for name in SIDE_FILES:
        if side_files_dir is not None and (side_files_dir / name).exists():
            continue  # NOTE: the caller's own (LoongTrainer's processing class), written above
        if (writer.out_dir / name).exists():
            continue  # NOTE: the user's own (a tokenizer saved there first): kept by the writer's carry_over
        if (source / name).is_file():
            writer.copy_file(name, source / name)
        elif (source / name).is_dir():
            for f in sorted((source / name).glob("*.jinja")):
                writer.copy_file(f"{name}/{f.name}", f)


def copy_folder_into(writer, folder: Path) -> None:
    """Every file under ``folder`` (a processing class's ``save_pretrained`` output) into the writer's folder, at the
    same relative path."""
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            writer.copy_file(path.relative_to(folder).as_posix(), path)
