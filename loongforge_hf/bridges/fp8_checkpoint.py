"""FP8 checkpoints from the hub (DeepSeek-V3 style), dequantised while they load.

Choices:
- The format: a ``<name>.weight`` stored as ``float8_e4m3fn`` next to ``<name>.weight_scale_inv``, fp32 decoding
  scales of 128x128 blocks (``weight = fp8 * scale_inv`` per block), as in a config's ``quantization_config``
  ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``. Detection goes by the tensors (an FP8 weight with
  its scales), not by the config, so a checkpoint is read right whatever its config says.
- ``dequantizing_reader`` wraps a ``CheckpointReader``: the weight reads back dequantised (bf16, the dtype these
  checkpoints were trained in; the model's own dtype is applied when the value is copied in) and the scales vanish
  from ``keys()``, so bridges see an ordinary bf16 checkpoint. A tensor-parallel slice reads only the FP8 rows or
  columns it needs and the scale blocks that cover them.
- ``dequantizing_reader`` is the one entry point for every format read dequantised: it also applies the MXFP4
  wrapper (gpt-oss experts, ``mxfp4_checkpoint.py``) beneath the FP8 one, so a bridge never sees quantised tensors,
  and beneath both the names of a GPT-2-family base-model checkpoint get their ``transformer.`` prefix and those a
  bridge's ``checkpoint_aliases`` rename get the bridge's names (``base_model_prefix.py``), and on top of all the
  ``optional_tensors`` a checkpoint lacks read as the value transformers starts them at (``optional_tensors.py``):
  every call site that reads for a bridge passes it (``bridge=``).
- Export writes plain bf16 (or ``dtype=``) weights; ``drop_dequantized_quantization`` removes an FP8 or MXFP4
  ``quantization_config`` from the exported config.json so transformers does not take them for quantised ones.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges.base_model_prefix import base_model_reader
from loongforge_hf.bridges.checkpoint_io import CheckpointError
from loongforge_hf.bridges.mxfp4_checkpoint import mxfp4_reader
from loongforge_hf.bridges.optional_tensors import FilledReader, filled_reader
from loongforge_hf.kernels.fp8 import GROUP, Fp8Error, dequantize_blocks

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
DEQUANT_DTYPE = torch.bfloat16
DEQUANTIZED_METHODS = ("fp8", "mxfp4")  # quant_method of the checkpoints read back dequantised here


def fp8_weight_names(reader) -> list[str]:
    """Checkpoint tensors stored in FP8 with block scales beside them."""
    names = set(reader.keys())
    return [n for n in names if n + SCALE_SUFFIX in names and reader.dtype(n) in FP8_DTYPES]


def quant_method(quantization_config) -> str | None:
    """The ``quant_method`` of a ``quantization_config`` (a dict or a transformers config object), if any."""
    qc = quantization_config if isinstance(quantization_config, dict) else getattr(quantization_config, "__dict__",
                                                                                   None) or {}
    return qc.get("quant_method")


def drop_dequantized_quantization(config: dict) -> bool:
    """Remove an FP8 or MXFP4 ``quantization_config`` from a config dict (export writes dequantised weights); say
    if it did."""
    if quant_method(config.get("quantization_config")) in DEQUANTIZED_METHODS:
        del config["quantization_config"]
        return True
    return False


class DequantizingReader:
    """A ``CheckpointReader`` whose FP8 block-scaled weights read back dequantised and whose scales are hidden."""

    def __init__(self, reader, fp8_names) -> None:
        self.reader = reader
        self.fp8 = set(fp8_names)
        hidden = {n + SCALE_SUFFIX for n in self.fp8}
        self._keys = [n for n in reader.keys() if n not in hidden]
        for name in sorted(self.fp8):
            shape, scale_shape = reader.shape(name), reader.shape(name + SCALE_SUFFIX)
            want = tuple(-(-s // GROUP) for s in shape)
            if len(shape) != 2 or tuple(scale_shape) != want:
                raise CheckpointError(f"{reader.folder}: FP8 tensor {name!r} of shape {tuple(shape)} needs 128x128 "
                                      f"block scales {name + SCALE_SUFFIX!r} of shape {want}, found "
                                      f"{tuple(scale_shape)}.")

    def __getattr__(self, attr):  # folder, format, opened_files, shard_of, validate_shapes, close ...
        return getattr(self.reader, attr)

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def dtype(self, name: str) -> torch.dtype:
        return DEQUANT_DTYPE if name in self.fp8 else self.reader.dtype(name)

    def _dequantize(self, name: str, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        try:
            return dequantize_blocks(data, scale, DEQUANT_DTYPE)
        except Fp8Error as err:
            raise CheckpointError(f"{self.reader.folder}: tensor {name!r}: {err}") from err

    def get(self, name: str) -> torch.Tensor:
        if name not in self.fp8:
            return self.reader.get(name)
        return self._dequantize(name, self.reader.get(name), self.reader.get(name + SCALE_SUFFIX))

    def get_slice(self, name: str, *, dim: int, start: int, stop: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        if name not in self.fp8:
            return self.reader.get_slice(name, dim=dim, start=start, stop=stop, out=out)
        if out is not None:
            return out.copy_(self.get_slice(name, dim=dim, start=start, stop=stop))
        dim %= 2
        first, last = start // GROUP, -(-stop // GROUP)
        # NOTE: read the FP8 rows/columns of whole blocks, dequantise, then cut the slice out of the first block.
        data = self.reader.get_slice(name, dim=dim, start=first * GROUP,
                                     stop=min(last * GROUP, self.reader.shape(name)[dim]))
        scale = self.reader.get_slice(name + SCALE_SUFFIX, dim=dim, start=first, stop=last)
        full = self._dequantize(name, data, scale)
        return full.narrow(dim, start - first * GROUP, stop - start).contiguous()


def dequantizing_reader(reader, *, bridge=None):
    """``reader`` itself, or wrapped so that its MXFP4 tensors (``mxfp4_checkpoint.Mxfp4Reader``) and FP8
    block-scaled weights (a ``DequantizingReader`` on top) read back dequantised, its tensors show the names
    ``bridge`` reads (its ``checkpoint_aliases``, none for most bridges) and the ``optional_tensors`` the checkpoint
    lacks read as their values (a ``FilledReader`` on top of all)."""
    if not isinstance(reader, (DequantizingReader, FilledReader)):
        reader = mxfp4_reader(base_model_reader(reader, getattr(bridge, "checkpoint_aliases", ())))
        names = fp8_weight_names(reader)
        reader = DequantizingReader(reader, names) if names else reader
    return filled_reader(reader, bridge)
