"""Learned absolute position embeddings (GPT-2's ``wpe``): megatron's ``LanguageModelEmbedding`` with
``position_embedding_type="learned_absolute"`` adds ``position_embeddings(position_ids)`` to the token embeddings.

Choices:
- A bridge says ``position_embedding_type = "learned_absolute"`` (the builder passes it to ``GPTModel``, whose table
  has ``max_position_embeddings`` rows: GPT-2's ``n_positions``). The table is a plain ``nn.Embedding`` on the first
  pipeline stage, whole on every TP rank (megatron does not split it; its gradient is the same on every TP rank, as
  a norm's) and loaded / exported by the bridge's ``first_stage_mappings``.
- The positions are the tokens' true ones wherever the embedding runs: the forward's ``position_ids`` (or
  ``0 .. s-1``), cut to each context-parallel rank's load-balanced chunks with the tokens
  (``context_parallel.cp_local_inputs`` keeps global positions); generate's positions (transformers counts them from
  each row's first real token under left padding: ``cumsum(attention_mask) - 1``) in the uncached and the cached
  forward alike; a cached step without them continues the cached tokens (``past + 0 .. given-1``, transformers'
  default) (``step_positions``).
- An offset (OPT's: position ``p`` reads row ``p + 2`` of a table of ``max_position_embeddings + 2`` rows, rows 0
  and 1 read by no real token) is the table's own (``PositionTable.offset``): positions stay the tokens' true ones.
- A fixed sinusoidal table (XGLM's: transformers' non-persistent buffer, never saved) is computed in place of the
  learned one (``use_position_table(sinusoidal=True)``: a buffer, not loaded, trained or exported); a token
  embedding scaled by ``sqrt(hidden_size)`` (BioGPT's, XGLM's ``scale_embedding``) before the positions are added
  gets the factor on the token embedding's output alone (``token_scale``).
- Too long: a forward whose positions reach past the table raises ``ValueError`` naming ``max_position_embeddings``
  before anything runs (``check_positions``; the trainer's ``check_batch`` does the same for a training batch). The
  padding rows the layout adds after the real tokens (sequence / context parallelism) may get positions past the
  table: ``PositionTable`` reads the last row for them (their outputs are never used: causality keeps them out of
  the real tokens').
- A model whose transformers class counts default positions from the attention mask (OPT; ``positions_from_mask``)
  gets them so where no ``position_ids`` are given (``mask_positions``: ``cumsum(attention_mask) * attention_mask -
  1``, padding at -1, a cached step's columns after the ``past`` ones, transformers' ``past_key_values_length``
  slicing): in the forward (uncached and cached; evaluation's), in LoongTrainer's training batches before their
  checks and in the online trainers' no-grad forwards (``with_mask_positions``). They then travel as given positions
  do (CP cuts them with the tokens, the first pipeline stage reads them).
"""

from __future__ import annotations

import math

import torch

LEARNED = "learned_absolute"


def learned_positions(bridge) -> bool:
    """Whether ``bridge``'s model adds learned absolute position embeddings."""
    return getattr(bridge, "position_embedding_type", "rope") == LEARNED


def reads_positions(bridge) -> bool:
    """Whether ``bridge``'s model reads the forward's ``position_ids``: learned absolute positions, or a rotation by
    them (``rotary_by_position_ids``: HunYuan's, whose q / k norms after the rotation see the absolute angle) instead
    of megatron's by slot."""
    return learned_positions(bridge) or getattr(bridge, "rotary_by_position_ids", False)


def check_positions(max_positions: int, *, length: int, past: int = 0, position_ids: torch.Tensor | None = None,
                    arch: str = "this model") -> None:
    """``ValueError`` where a forward of ``length`` new tokens after ``past`` cached ones (or its ``position_ids``)
    needs positions outside ``0 .. max_positions - 1``."""
    if position_ids is not None and position_ids.numel():
        low, high = int(position_ids.min()), int(position_ids.max())
        if low < 0 or high >= max_positions:
            raise ValueError(f"position_ids from {low} to {high} are outside {arch}'s learned position table of "
                             f"max_position_embeddings={max_positions} rows (positions 0 .. {max_positions - 1}).")
        return
    if past + length > max_positions:
        raise ValueError(f"{past + length} positions ({past} cached + {length} given) are more than {arch}'s "
                         f"max_position_embeddings={max_positions} (a learned position table); truncate the input "
                         "to that length.")


def mask_positions(bridge, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, *,
                   past: int = 0, length: int | None = None) -> torch.Tensor | None:
    """The forward's ``position_ids``: as given, else for a model whose transformers class counts them from the
    attention mask (``bridge.positions_from_mask``: OPT's ``cumsum(attention_mask) * attention_mask - 1``, the
    ``past`` cached columns cut off) those of a 2-D ``attention_mask``; else None (the slots'). ``ValueError`` where
    that mask is not ``past + length`` columns long."""
    if position_ids is not None or attention_mask is None or attention_mask.dim() != 2 \
            or not getattr(bridge, "positions_from_mask", False):
        return position_ids
    if length is not None and attention_mask.shape[-1] != past + length:
        raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns; {past} cached + {length} given "
                         f"tokens need {past + length} (the positions are counted from it).")
    mask = attention_mask.long()
    return (mask.cumsum(-1) * mask - 1)[:, past:]


def with_mask_positions(bridge, batch) -> None:
    """A batch's ``position_ids`` from its attention mask where ``mask_positions`` derives them (in place)."""
    positions = mask_positions(bridge, batch.get("attention_mask"), batch.get("position_ids"))
    if positions is not None:
        batch["position_ids"] = positions


def step_positions(position_ids: torch.Tensor | None, *, batch: int, past: int, given: int, padded: int,
                   device) -> torch.Tensor:
    """``[batch, padded]`` positions of a cached step's ``given`` new tokens (``position_ids``, else ``past ..``),
    followed by the layout's ``padded - given`` padding tokens, which continue them."""
    if position_ids is None:
        position_ids = torch.arange(past, past + given, device=device).expand(batch, given)
    position_ids = position_ids.to(device).expand(batch, given)
    if padded == given:
        return position_ids
    tail = position_ids[:, -1:] + torch.arange(1, padded - given + 1, device=device)
    return torch.cat([position_ids, tail], dim=1)


class PositionTable(torch.nn.Embedding):
    """megatron's position embedding table, position ``p`` reading row ``p + offset`` (OPT's 2), with positions past
    it (the layout's padding only: the forward refuses longer inputs first) reading its last row."""

    def __init__(self, *args, offset: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward((positions + self.offset).clamp(max=self.num_embeddings - 1))


def use_position_table(chunk, *, offset: int = 0, token_scale: float = 1.0, sinusoidal: bool = False,
                       padding_idx: int | None = None) -> None:
    """Put a ``PositionTable`` in place of ``chunk``'s position embedding (first pipeline stage): the same weight, or
    with ``offset`` a new one of ``offset`` more rows (transformers' ``OPTLearnedPositionalEmbedding``); with
    ``sinusoidal`` a fixed table (``sinusoidal_table``, a non-persistent buffer: not loaded, trained or saved). The
    token embedding's output times ``token_scale`` where it is not 1 (transformers' ``embed_scale``)."""
    embedding = getattr(chunk, "embedding", None)
    old = getattr(embedding, "position_embeddings", None)
    if old is None:
        return
    table = PositionTable(old.num_embeddings + offset, old.embedding_dim, offset=offset, device="meta")
    w = old.weight
    if sinusoidal:
        del table.weight
        table.register_buffer("weight", sinusoidal_table(table.num_embeddings, w.shape[1], padding_idx=padding_idx)
                              .to(w.device, w.dtype), persistent=False)
    else:
        # NOTE: no draw from the random generator: the loader fills the new rows' weight
        table.weight = torch.nn.Parameter(torch.empty(table.num_embeddings, w.shape[1], device=w.device,
                                                      dtype=w.dtype), requires_grad=w.requires_grad) if offset else w
    embedding.position_embeddings = table
    if token_scale != 1.0:
        from loongforge_hf.bridges.layer_outputs import _rescale

        _rescale(embedding.word_embeddings, token_scale)


def sinusoidal_table(rows: int, dim: int, *, padding_idx: int | None = None) -> torch.Tensor:
    """fairseq's sinusoidal positions as transformers' ``XGLMSinusoidalPositionalEmbedding.get_embedding`` builds
    them (fp32): ``[sin | cos]`` of ``position * 10000 ** (-i / (dim / 2 - 1))``, an odd ``dim``'s last channel 0, the
    ``padding_idx`` row 0."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    if padding_idx is not None:
        table[padding_idx] = 0
    return table
