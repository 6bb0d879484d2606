"""Checkpoint tensors read under other names than the file's: the names a bridge declares, where a checkpoint on the
hub stores a tensor under another name that transformers reads too.

- A base model's checkpoint, without the ``transformer.`` prefix the causal LM's names carry: OpenAI's ``gpt2`` (and
  gpt2-medium / large / xl) on the hub store ``wte.weight``, ``h.0.attn.c_attn.weight`` ..., which transformers loads
  into ``GPT2LMHeadModel`` by adding its ``base_model_prefix``.
- A bridge's ``checkpoint_aliases``: ``(pattern, replacement)`` pairs of regular expressions over the names; a file
  name that matches the pattern reads under the replaced name when the file has no tensor of that name (Kimi Linear:
  the hub names its dense layer's MLP ``mlp``, transformers writes ``block_sparse_moe``).

Choices:
- One ``RenamedReader`` for both: it shows each tensor under its new name and reads it from the file under its own.
  It sits beneath ``fp8_checkpoint.dequantizing_reader(reader, bridge=)``, the one place every read goes through
  (load, shape check, loading info, export's passthrough); a bridge without ``checkpoint_aliases`` reads as before.
- The prefix is detected by the tensors, as transformers does by the names: a checkpoint with ``wte.weight`` and no
  tensor under ``transformer.`` shows each of its tensors as ``transformer.<name>`` (an ``lm_head.*`` tensor keeps
  its name), so the GPT-2-family bridges (``transformer.wte`` / ``transformer.h.N``) see the names they declare.
  Aliases apply after the prefix. Nothing else is renamed.
- Both names in one file (an alias and its target): the target's tensor is read, the aliased one is ignored (not
  loaded, not listed as unexpected, not written back), as transformers 5.24 loads Kimi Linear's (its renamed tensors
  go by the name first in sorted order: ``block_sparse_moe`` before ``mlp``).
- A shape check that fails names the tensors as they are in the file.
- Export writes the bridge's names, as ``save_pretrained`` does after loading such a checkpoint; the tensors export
  passes through come read by their new names, so none is written twice.
"""

from __future__ import annotations

import re

PREFIX = "transformer."
_MARKER = "wte.weight"  # NOTE: the token embedding of a GPT-2-family base model


class RenamedReader:
    """``reader`` with its tensors shown under other names (``names``: shown name -> name in the file)."""

    def __init__(self, reader, names: dict[str, str]) -> None:
        self.reader = reader
        self._raw = names

    def __getattr__(self, attr):  # NOTE: folder, format, close ... of the wrapped reader
        return getattr(self.reader, attr)

    def raw_name(self, name: str) -> str:
        return self._raw.get(name, name)

    def keys(self) -> list[str]:
        return list(self._raw)

    def __contains__(self, name: object) -> bool:
        return name in self._raw

    def __len__(self) -> int:
        return len(self._raw)

    def shard_of(self, name: str) -> str:
        return self.reader.shard_of(self.raw_name(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self.raw_name(name))

    def dtype(self, name: str):
        return self.reader.dtype(self.raw_name(name))

    def get(self, name: str):
        return self.reader.get(self.raw_name(name))

    def get_slice(self, name: str, *, dim: int, start: int, stop: int, out=None):
        return self.reader.get_slice(self.raw_name(name), dim=dim, start=start, stop=stop, out=out)

    def validate_shapes(self, expected) -> None:
        self.reader.validate_shapes({self.raw_name(n): shape for n, shape in expected.items()})


def prefixed(names: list[str]) -> dict[str, str]:
    """Shown name -> file name: ``transformer.<name>`` for a GPT-2-family base model's tensors, else each its own."""
    if _MARKER in names and not any(n.startswith(PREFIX) for n in names):
        return {(n if n.startswith("lm_head.") else PREFIX + n): n for n in names}
    return {n: n for n in names}


def _alias(name: str, aliases) -> str:
    """``name`` as the first alias whose pattern it matches replaces it, else as it is."""
    for pattern, replacement in aliases:
        if re.search(pattern, name):
            return re.sub(pattern, replacement, name)
    return name


def aliased(names: dict[str, str], aliases) -> dict[str, str]:
    """``names`` (shown -> file) with each shown name an alias renames shown under its new name, unless that name is
    there already (then the aliased tensor is left out: module docstring)."""
    out = {}
    for shown, raw in names.items():
        new = _alias(shown, aliases)
        if new == shown or new not in names:
            out[new] = raw
    return out


def base_model_reader(reader, aliases=()):
    """``reader``, or a ``RenamedReader`` over it for a GPT-2-family base-model checkpoint or a name ``aliases``
    (``(pattern, replacement)`` pairs) rename (module docstring)."""
    if isinstance(reader, RenamedReader):
        return reader
    files = list(reader.keys())
    names = aliased(prefixed(files), aliases)
    return reader if list(names.items()) == [(n, n) for n in files] else RenamedReader(reader, names)
