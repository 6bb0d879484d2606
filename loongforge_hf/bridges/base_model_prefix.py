"""Checkpoints saved from a base model, without the ``transformer.`` prefix the causal LM's names carry: OpenAI's
``gpt2`` (and gpt2-medium / large / xl) on the hub store ``wte.weight``, ``h.0.attn.c_attn.weight`` ..., which
transformers loads into ``GPT2LMHeadModel`` by adding its ``base_model_prefix``.

Choices:
- Detected by the tensors, as transformers does by the names: a checkpoint with ``wte.weight`` and no tensor under
  ``transformer.`` reads through ``PrefixedReader``, which shows each of its tensors as ``transformer.<name>`` (an
  ``lm_head.*`` tensor keeps its name), so the GPT-2-family bridges (``transformer.wte`` / ``transformer.h.N``) see
  the names they declare. Nothing else is renamed.
- Reads go to the file under its own name; a shape check that fails names the tensors as they are in the file.
- Export writes the names transformers writes (``transformer.*``), as ``save_pretrained`` does after loading it.
"""

from __future__ import annotations

PREFIX = "transformer."
_MARKER = "wte.weight"  # NOTE: the token embedding of a GPT-2-family base model


class PrefixedReader:
    """``reader`` with its tensors named ``transformer.<name>`` (``lm_head.*`` as they are)."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self._raw = {(n if n.startswith("lm_head.") else PREFIX + n): n for n in reader.keys()}

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


def base_model_reader(reader):
    """``reader``, or a ``PrefixedReader`` over it for a GPT-2-family base-model checkpoint (module docstring)."""
    if isinstance(reader, PrefixedReader):
        return reader
    names = reader.keys()
    if _MARKER in names and not any(n.startswith(PREFIX) for n in names):
        return PrefixedReader(reader)
    return reader
