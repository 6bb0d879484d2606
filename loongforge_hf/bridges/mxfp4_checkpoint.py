"""MXFP4 checkpoints from the hub (gpt-oss style), dequantised while they load.

Choices:
- The format, as openai/gpt-oss-* store their routed experts (config ``quantization_config``
  ``{"quant_method": "mxfp4", ...}``): a parameter ``<name>`` of layout ``[E, C, R]`` is stored as ``<name>_blocks``
  (uint8 ``[E, R, C/32, 16]``, two FP4 e2m1 codes per byte, low nibble first) and ``<name>_scales`` (uint8
  ``[E, R, C/32]``, one E8M0 exponent per 32 values, bias 127). The value of a code is its e2m1 number times
  ``2**(scale - 127)``; the dequantised ``[E, R, C]`` is transposed to the parameter's ``[E, C, R]``
  (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``), as transformers' ``convert_moe_packed_tensors``
  reads them. Detection goes by the tensors (a uint8 ``_blocks`` / ``_scales`` pair), not by the config.
- ``Mxfp4Reader`` wraps a ``CheckpointReader``: ``<name>`` reads back dequantised in bf16 (the dtype gpt-oss was
  trained in; the model's own dtype is applied when the value is copied in) and the ``_blocks`` / ``_scales`` names
  vanish from ``keys()``. A slice along the experts (dim 0) reads only those experts' bytes; a slice along dim 1
  reads the 32-wide groups that cover it, along dim 2 its rows.
- Every value is exact: ``e2m1 * 2**(scale - 127)`` rounded once to bf16, which only rounds on overflow (to
  +-inf) since e2m1 values have two significant bits. Edge scales follow transformers (checked against its
  ``torch.ldexp``): scale 0 gives ``2**-127`` (bf16 subnormals, not flushed to zero), scale 255 gives ``2**128``,
  so a block reads 0.5 as ``2**127``, larger values as +-inf and zeros as +-0 -- no NaN, although the OCP MX spec
  calls E8M0 255 NaN.
- The arithmetic is one table lookup: a 256 scales x 256 bytes table of bf16 pairs, built exactly in fp64.
"""

from __future__ import annotations

from typing import Mapping

import torch

from loongforge_hf.bridges.checkpoint_io import CheckpointError

BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # values that share one scale: 16 bytes of two codes
DEQUANT_DTYPE = torch.bfloat16
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; code | 8 is the same value negated
_TABLE: torch.Tensor | None = None


def _byte_table() -> torch.Tensor:
    """bf16 ``[256 * 256, 2]``: row ``scale * 256 + byte`` holds the byte's low-nibble and high-nibble values."""
    global _TABLE
    if _TABLE is None:
        codes = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float64)
        powers = torch.exp2(torch.arange(256, dtype=torch.float64) - 127)
        values = (powers[:, None] * codes[None, :]).to(DEQUANT_DTYPE)  # [scale, code], exact but for overflow
        byte = torch.arange(256)
        _TABLE = torch.stack((values[:, byte & 15], values[:, byte >> 4]), dim=-1).reshape(-1, 2).contiguous()
    return _TABLE


def _dequantize_into(dest: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """One expert: ``blocks`` ``[R, G, 16]`` and ``scales`` ``[R, G]`` dequantised into ``dest`` ``[G * 32, R]``."""
    index = scales.to(torch.int32).unsqueeze(-1) * 256 + blocks  # int32 [R, G, 16]
    pairs = torch.nn.functional.embedding(index, _byte_table())  # [R, G, 16, 2]: low nibble first
    dest.copy_(pairs.view(blocks.shape[0], -1).t())


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks`` ``[E, R, G, 16]`` / ``scales`` ``[E, R, G]`` (uint8) as the bf16 parameter ``[E, G * 32, R]``."""
    experts, rows, groups = scales.shape
    out = torch.empty(experts, groups * GROUP, rows, dtype=DEQUANT_DTYPE)
    for e in range(experts):
        _dequantize_into(out[e], blocks[e], scales[e])
    return out


def _pairs(reader) -> dict[str, tuple[str, str]]:
    """``{parameter: (blocks, scales)}`` of the MXFP4 tensors of ``reader``, each pair checked."""
    names = set(reader.keys())
    found = {}
    for name in names:
        for own, other in ((BLOCKS, SCALES), (SCALES, BLOCKS)):
            if not name.endswith(own):
                continue
            base = name[:-len(own)]
            if base + other in names:
                found[base] = (base + BLOCKS, base + SCALES)
            elif reader.dtype(name) == torch.uint8:
                raise CheckpointError(f"{reader.folder}: MXFP4 tensor {name!r} has no {base + other!r} beside it "
                                      "(a checkpoint with MXFP4 weights stores both).")
    for base in list(found):
        blocks, scales = found[base]
        dtypes = (reader.dtype(blocks), reader.dtype(scales))
        if torch.uint8 not in dtypes:
            del found[base]  # not MXFP4: some other model's tensors that happen to end so
            continue
        b_shape, s_shape = tuple(reader.shape(blocks)), tuple(reader.shape(scales))
        where = f"{reader.folder}: MXFP4 tensors {blocks!r} {list(b_shape)} / {scales!r} {list(s_shape)}"
        if dtypes != (torch.uint8, torch.uint8):
            raise CheckpointError(f"{where}: both must be uint8, found {dtypes[0]} / {dtypes[1]}.")
        if len(b_shape) != 4 or b_shape[-1] != GROUP // 2 or b_shape[:-1] != s_shape:
            raise CheckpointError(f"{where}: expected blocks [experts, rows, groups, {GROUP // 2}] and scales "
                                  "[experts, rows, groups].")
        if base in names:
            raise CheckpointError(f"{reader.folder}: tensor {base!r} is stored both plain and as MXFP4 "
                                  f"({blocks!r} / {scales!r}).")
    return found


class Mxfp4Reader:
    """A ``CheckpointReader`` whose MXFP4 ``<name>_blocks`` / ``<name>_scales`` read back as bf16 ``<name>``."""

    def __init__(self, reader, pairs: dict[str, tuple[str, str]]) -> None:
        self.reader = reader
        self.mxfp4 = dict(pairs)
        blocks_of = {b: base for base, (b, _) in self.mxfp4.items()}
        hidden = {s for _, s in self.mxfp4.values()}
        self._keys = [blocks_of.get(n, n) for n in reader.keys() if n not in hidden]
        self._names = set(self._keys)
        self._shapes = {}
        for base, (blocks, _) in self.mxfp4.items():
            experts, rows, groups, _ = reader.shape(blocks)
            self._shapes[base] = (experts, groups * GROUP, rows)

    def __getattr__(self, attr):  # folder, format, opened_files, close ...
        return getattr(self.reader, attr)

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._keys)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name] if name in self.mxfp4 else self.reader.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return DEQUANT_DTYPE if name in self.mxfp4 else self.reader.dtype(name)

    def shard_of(self, name: str) -> str:
        return self.reader.shard_of(self.mxfp4[name][0] if name in self.mxfp4 else name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.mxfp4:
            return self.reader.get(name)
        return self.get_slice(name, dim=0, start=0, stop=self._shapes[name][0])

    def get_slice(self, name: str, *, dim: int, start: int, stop: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        if name not in self.mxfp4:
            return self.reader.get_slice(name, dim=dim, start=start, stop=stop, out=out)
        shape = self._shapes[name]
        if not -3 <= dim < 3 or not 0 <= start <= stop <= shape[dim % 3]:
            raise CheckpointError(f"Tensor {name!r} has shape {shape}; slice {start}:{stop} along dim {dim} is "
                                  "out of range.")
        dim %= 3
        want = shape[:dim] + (stop - start,) + shape[dim + 1:]
        if out is not None and (tuple(out.shape) != want or out.dtype != DEQUANT_DTYPE):
            raise CheckpointError(f"Tensor {name!r}: cannot read {DEQUANT_DTYPE} {list(want)} into a {out.dtype} "
                                  f"{list(out.shape)} tensor.")
        result = out if out is not None else torch.empty(want, dtype=DEQUANT_DTYPE)
        blocks, scales = self.mxfp4[name]
        if dim == 0:  # NOTE: expert by expert, so no more than one expert's bytes are held at a time
            for i in range(stop - start):
                one = dict(dim=0, start=start + i, stop=start + i + 1)
                _dequantize_into(result[i], self.reader.get_slice(blocks, **one)[0],
                                 self.reader.get_slice(scales, **one)[0])
            return result
        # dim 1 (C) is the stored groups' dim 2, 32 values a group; dim 2 (R) is the stored rows' dim 1
        first, last = (start // GROUP, -(-stop // GROUP)) if dim == 1 else (start, stop)
        part = dict(dim=3 - dim, start=first, stop=last)
        b, s = self.reader.get_slice(blocks, **part), self.reader.get_slice(scales, **part)
        offset = start - first * (GROUP if dim == 1 else 1)
        for e in range(shape[0]):
            full = torch.empty(s.shape[2] * GROUP, s.shape[1], dtype=DEQUANT_DTYPE)
            _dequantize_into(full, b[e], s[e])
            result[e].copy_(full.narrow(dim - 1, offset, stop - start))
        return result

    def validate_shapes(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """``CheckpointReader.validate_shapes``, the MXFP4 parameters checked by their dequantised shapes first."""
        problems = [f"{n!r}: expected shape {tuple(want)}, found {self._shapes[n]} (stored as MXFP4)"
                    for n, want in expected.items() if n in self.mxfp4 and tuple(want) != self._shapes[n]]
        if problems:
            raise CheckpointError(f"The checkpoint at {self.reader.folder} does not match the model its config.json "
                                  f"describes ({len(problems)} tensor(s)):\n  " + "\n  ".join(problems))
        self.reader.validate_shapes({n: s for n, s in expected.items() if n not in self.mxfp4})


def mxfp4_reader(reader):
    """``reader`` itself, or an ``Mxfp4Reader`` over it when the checkpoint holds MXFP4 tensors."""
    if isinstance(reader, Mxfp4Reader):
        return reader
    pairs = _pairs(reader)
    return Mxfp4Reader(reader, pairs) if pairs else reader
