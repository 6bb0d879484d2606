"""The HF -> megatron -> HF round-trip check shared by the bridge tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

DEFAULT_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def read_all(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors shard in ``folder``."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def check_round_trip(src: str | Path, dst: str | Path, *, side_files: tuple[str, ...] = DEFAULT_SIDE_FILES) -> None:
    """Same tensor names, dtypes, shapes and bytes; the same config.json; ``side_files`` byte-identical; an index
    (when the export has one) that lists exactly the tensors."""
    src, dst = Path(src), Path(dst)
    a, b = read_all(src), read_all(dst)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), f"{name} differs after HF -> megatron -> HF"
    assert json.loads((src / "config.json").read_text()) == json.loads((dst / "config.json").read_text())
    for side in side_files:
        assert (src / side).read_bytes() == (dst / side).read_bytes(), side
    index = dst / "model.safetensors.index.json"
    if index.exists():
        assert set(json.loads(index.read_text())["weight_map"]) == set(a)
