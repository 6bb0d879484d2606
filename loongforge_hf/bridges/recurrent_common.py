"""What the recurrent token mixers share (Gated DeltaNet ``gated_deltanet.py``, Mamba2 ``mamba2.py``): a cached
generate step's inputs, the column- / row-parallel projections, and the token layout read from megatron's mask.

Choices:
- ``_token_layout`` reads a mask's layout (real tokens, packed document starts) with one wait for the device per mask
  tensor: memoised on the mask object and its version counter (``_LAYOUT_MEMO``), read again for a new mask or after
  the mask is written to.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from loongforge_hf.parallel.delta_rule_cp import read_cp_layout


@dataclass(frozen=True)
class CachedStep:
    """What a cached generate step gives a Gated DeltaNet layer: the cache (a ``transformers.Cache``) and the index of
    the layer's states in it; the step's ``given`` new tokens (the layout's padding after them); ``real`` ``[b, given]``
    False where transformers' mask marks a token as padding (None: all real)."""

    cache: object
    index: int
    given: int
    real: torch.Tensor | None


def tp_group_of(pg_collection):
    """The tensor-parallel group megatron hands a layer (``pg_collection.tp``), else the global one."""
    group = getattr(pg_collection, "tp", None)
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group(check_initialized=False)
    return group


def mixer_on_layers(layers: frozenset[int], mixer: type, attention: type, **mixer_kwargs) -> type:
    """The self-attention slot's class: ``mixer`` (with ``mixer_kwargs``) on the layers in ``layers`` (0-based global
    indices; megatron passes the layer number from 1, offset by the pipeline stage), ``attention`` elsewhere."""

    class ByLayer:
        def __new__(cls, config, submodules=None, layer_number: int = 1, **kwargs):
            if layer_number - 1 in layers:
                return mixer(config, layer_number=layer_number, pg_collection=kwargs.get("pg_collection"),
                             **mixer_kwargs)
            return attention(config, submodules, layer_number, **kwargs)

    return ByLayer


def mixer_sharded_state_dict(module: torch.nn.Module, prefix: str, sharded_offsets: tuple, metadata: dict | None,
                             own: dict[str, torch.nn.Parameter], axes: dict[str, int] | None = None) -> dict:
    """A mixer's ``sharded_state_dict`` (megatron's distributed checkpoint): its child modules' as megatron's default,
    its own parameters ``own`` split over TP along ``axes`` (each name's dim; default 0 for all; a name left out is
    replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

    out = {}
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
    out.update(make_sharded_tensors_for_checkpoint(own, prefix, {n: 0 for n in own} if axes is None else axes,
                                                   sharded_offsets))
    return out


def mixer_projections(config, *, in_size: int, out_size: int, bias: bool = False, tp_group=None):
    """A recurrent mixer's column-parallel ``in_proj`` (``in_size``: all ranks' rows) and row-parallel ``out_proj``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    kw = dict(config=config, bias=bias, skip_bias_add=True, tp_group=tp_group)
    h = config.hidden_size
    return (ColumnParallelLinear(h, in_size, init_method=config.init_method, gather_output=False, **kw),
            RowParallelLinear(out_size, h, init_method=config.output_layer_init_method, input_is_parallel=True, **kw))


_LAYOUT_MEMO: list = [None]  # NOTE: (weakref to the mask, its version, batch, seq, CP group, layout) of the last read


def _token_layout(mask: torch.Tensor | None, batch: int, seq: int, *, group=None):
    """From megatron's ``[b, 1, s, s]`` mask (True = masked; None = plain causal): the real tokens ``[b, s]`` (None
    when all are) and each row's document starts after its first token (None when no row is packed). Under context
    parallelism (``group``) the mask is this rank's rows ``[b, 1, s_local, s]`` and the layout
    ``delta_rule_cp.read_cp_layout``'s (collective: every rank of the group reads the same masks). Reading it waits
    for the device; megatron hands every layer of a forward the same mask tensor, so the layout is kept for that
    tensor (while it lives and is not written to) and the wait happens once per forward, not once per layer."""
    if mask is None:
        return None, None
    memo = _LAYOUT_MEMO[0]
    if memo is not None and memo[0]() is mask and memo[1:5] == (mask._version, batch, seq, group):
        return memo[5]
    layout = _read_layout(mask, batch, seq) if group is None else read_cp_layout(mask, batch, seq, group)
    _LAYOUT_MEMO[0] = (weakref.ref(mask), mask._version, batch, seq, group, layout)
    return layout


@functools.lru_cache(maxsize=16)
def _cu_seqlens(bounds: tuple, seq: int, device: torch.device) -> torch.Tensor:
    """fla's ``cu_seqlens`` of the rows' documents flattened into one row, kept for the next layers of a forward."""
    return torch.tensor([row * seq + c for row, cuts in enumerate(bounds) for c in cuts[:-1]] + [len(bounds) * seq],
                        device=device)


def _read_layout(mask: torch.Tensor, batch: int, seq: int):
    rows = mask[:, 0] if mask.dim() == 4 else mask
    if tuple(rows.shape[-2:]) != (seq, seq):
        raise ValueError(f"Gated DeltaNet / Mamba2: attention mask of shape {tuple(mask.shape)} for {seq} tokens.")
    real = ~rows.diagonal(dim1=-2, dim2=-1).expand(batch, seq)
    before = rows.diagonal(offset=-1, dim1=-2, dim2=-1).expand(batch, seq - 1)  # token t masked from t - 1
    cut = before & real[:, 1:] & real[:, :-1]
    starts = None
    if bool(cut.any()):
        starts = [(torch.nonzero(row).flatten() + 1).tolist() for row in cut]
    return (None if bool(real.all()) else real), starts
