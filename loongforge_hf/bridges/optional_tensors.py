"""Checkpoint tensors a bridge may find absent: transformers' model holds them, a released checkpoint does not store
them, and transformers starts them at a fixed value (A.X-K1's ``mlp.gate.e_score_correction_bias``: a buffer its
class lists in ``_keys_to_ignore_on_load_missing`` and ``_init_weights`` sets to zero, so it routes on the scores
alone).

Choices:
- A bridge's ``optional_tensors``: ``(pattern, value)`` pairs, a regular expression over the bridge's HF names and
  the value transformers starts such a tensor at. A name the bridge expects (``expected_hf_shapes``) that matches a
  pattern and is not in the checkpoint reads as a float32 tensor of its expected shape filled with that value (the
  model's dtype is applied when it is copied in; a mapping's ``hf_dtype`` keeps it on export). A checkpoint that has
  the tensor is read as it is.
- One ``FilledReader`` shows the absent tensors beside the checkpoint's. It sits on top of
  ``fp8_checkpoint.dequantizing_reader(reader, bridge=)``, the one place every read goes through (load, shape check,
  loading info, export's passthrough), so presence is judged by the names the bridge reads (after dequantisation and
  ``checkpoint_aliases``); a bridge without ``optional_tensors`` reads as before.
- Only the declared names may be absent: the shape check leaves out the filled ones and still fails, naming it, on
  any other missing tensor, on every rank before any collective.
- Loading info: transformers lists a filled tensor in ``missing_keys`` unless its class ignores it
  (``_keys_to_ignore_on_load_missing``: A.X-K1's, so none there); ``missing_keys`` is the same here.
- Export writes every mapped tensor from the model, a filled one included, as ``save_pretrained`` writes the buffer.
"""

from __future__ import annotations

import re

import torch

FILL_DTYPE = torch.float32


class FilledReader:
    """``reader`` with the tensors of ``filled`` (name -> (shape, value)) shown as if stored, each read as its
    value."""

    def __init__(self, reader, filled: dict[str, tuple[tuple[int, ...], float]]) -> None:
        self.reader = reader
        self.filled = dict(filled)
        self._names = set(reader.keys()) | set(self.filled)

    def __getattr__(self, attr):  # NOTE: folder, format, close ... of the wrapped reader
        return getattr(self.reader, attr)

    def keys(self) -> list[str]:
        return [*self.reader.keys(), *self.filled]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def shard_of(self, name: str) -> str:
        return "(not in the checkpoint: filled)" if name in self.filled else self.reader.shard_of(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.filled[name][0]) if name in self.filled else self.reader.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return FILL_DTYPE if name in self.filled else self.reader.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.filled:
            return self.reader.get(name)
        shape, value = self.filled[name]
        return torch.full(shape, value, dtype=FILL_DTYPE)

    def get_slice(self, name: str, *, dim: int, start: int, stop: int, out=None) -> torch.Tensor:
        if name not in self.filled:
            return self.reader.get_slice(name, dim=dim, start=start, stop=stop, out=out)
        value = self.get(name).narrow(dim, start, stop - start)
        return value.contiguous() if out is None else out.copy_(value)

    def validate_shapes(self, expected) -> None:
        self.reader.validate_shapes({n: shape for n, shape in expected.items() if n not in self.filled})


def _value_of(name: str, optional) -> float | None:
    """The value of the first ``(pattern, value)`` of ``optional`` whose pattern ``name`` matches, else None."""
    return next((float(value) for pattern, value in optional if re.search(pattern, name)), None)


def filled_reader(reader, bridge):
    """``reader``, or a ``FilledReader`` over it when ``bridge`` declares ``optional_tensors`` the checkpoint lacks."""
    optional = getattr(bridge, "optional_tensors", ())
    if not optional or isinstance(reader, FilledReader):
        return reader
    stored = set(reader.keys())
    filled = {n: (shape, value) for n, shape in bridge.expected_hf_shapes().items()
              if n not in stored and (value := _value_of(n, optional)) is not None}
    return FilledReader(reader, filled) if filled else reader


def missing_keys(reader, bridge) -> set[str]:
    """transformers' ``missing_keys`` for a checkpoint read through ``reader`` (``dequantizing_reader``'s): the filled
    tensors its model class does not ignore (``_keys_to_ignore_on_load_missing``)."""
    import transformers

    names = set(getattr(reader, "filled", ()))
    archs = getattr(bridge.hf_config, "architectures", None) or [""]
    ignored = getattr(getattr(transformers, archs[0], None), "_keys_to_ignore_on_load_missing", None) or ()
    if names and ignored:
        pattern = re.compile("|".join(f"({p})" for p in ignored))
        names = {n for n in names if pattern.search(n) is None}
    return names
