"""What the language model's output layer computes, changed for one forward: the final hidden states instead of
logits (``hidden_states_out``: the training loss is fused with the output GEMM, ``kernels.cross_entropy``), or the
logits of some positions only (``head_rows``: ``logits_to_keep``); and how the kept positions' full-vocabulary
logits reach every rank (``KeptRows``: the text models' ``runtime.forward_padded`` and the image-text models'
generate steps).

Choices:
- Both patch the output layer's ``forward`` on the instance for the duration (the class's stays) and find it through
  ``language_head``: the module of a chunk that has ``post_process`` and an ``output_layer`` (its last pipeline
  stage; None elsewhere).
- ``head_rows`` cuts the output layer's input ``[s, b, h]`` to the kept positions before the GEMM, so the language
  model returns ``[b, kept, V]``: generate's prefill asks for the last position only (``logits_to_keep=1``), and a
  whole prompt's logits are GiBs (8 x 512 positions x 151,936 bf16 are 1.2 GiB). The output layer is a per-position
  linear map: the kept rows are the same either way. Under context parallelism the rows are this rank's local
  indices of its share of them (``context_parallel.cp_local_rows``). Not under sequence parallelism (the layer's
  input is this rank's sequence slice, gathered inside it): the caller cuts the logits after the layer there
  (``runtime.forward_padded``).
- ``add_output_bias`` gives the output layer a bias (Phi's ``lm_head.bias``; megatron's ``GPTModel`` builds it
  without one): a parameter of megatron's ``ColumnParallelLinear`` as that class builds its own, this rank's rows of
  the padded vocabulary (``tensor_model_parallel``, split on dim 0), so megatron's forward adds it after the GEMM
  (logits, ``head_rows``, generate and its KV cache, ``lean_linear``), its gradient is this rank's rows' (no
  reduction), the checkpoint shards it as the weight and the loader fills it (``VocabParallel``). The fused training
  loss reads it beside the weight (``runtime.output_bias``). Beside a frozen weight, a trained bias is added after
  megatron's GEMM (its frozen-weight function would return the bias no gradient).
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch


def full_logits(local_logits: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """This tensor-parallel rank's vocabulary slice of the logits -> the whole vocabulary (gathered over TP)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(local_logits)[..., :vocab_size]


class KeptRows:
    """The logits of positions ``rows`` of a forward over ``seq`` positions (its CP share on this rank under context
    parallelism), on every rank: ``head`` is what the output layer may compute alone (``head_rows``: the slice, or
    under CP this rank's local indices of the kept positions; None where that is not exact or all are kept),
    ``logits(output)`` makes ``[b, kept, V]`` from the language model's output (TP gather; under CP each rank's own
    kept rows added up over the group, ``context_parallel.cp_gather_rows``, or all gathered when all are kept).
    ``cut``: whether the other positions' logits may go uncomputed (not when a loss over every position needs
    the output)."""

    def __init__(self, rows: slice, seq: int, *, vocab_size: int, sequence_parallel: bool, cut: bool = True,
                 device=None) -> None:
        from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_local_rows

        self.rows, self.seq, self.vocab_size = rows, seq, vocab_size
        self.group, cp_size, cp_rank = cp_group_and_size()
        some = cut and rows != slice(0, seq)
        self.index, self.places = cp_local_rows(seq, rows, cp_size, cp_rank, device) if some and cp_size > 1 \
            else (None, None)
        self.head = None if sequence_parallel or not some else (rows if self.group is None else self.index)

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        from loongforge_hf.parallel.context_parallel import cp_gather_rows, cp_gather_sequence

        if self.group is None:  # NOTE: the rows cut before the TP gather
            return full_logits(output if self.head is not None else output[:, self.rows], vocab_size=self.vocab_size)
        if self.index is not None:
            local = output if self.head is not None else output[:, self.index]
            return cp_gather_rows(full_logits(local, vocab_size=self.vocab_size).detach(), self.places,
                                  self.rows.stop - self.rows.start, self.group)
        return cp_gather_sequence(full_logits(output, vocab_size=self.vocab_size).detach(), self.seq, self.group,
                                  dim=1)[:, self.rows]


def keep_rows(given: int, keep: int) -> slice:
    """The positions whose logits ``logits_to_keep=keep`` keeps of ``given`` (all when ``keep`` is 0)."""
    return slice(given - min(keep, given), given) if keep > 0 else slice(0, given)


def language_head(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """The megatron language model of ``chunk`` that computes the logits (its last pipeline stage), or None."""
    for module in chunk.modules():
        if getattr(module, "post_process", False) and hasattr(module, "output_layer") \
                and hasattr(module, "shared_embedding_or_output_weight"):
            return module
    return None


def add_output_bias(chunk: torch.nn.Module) -> None:
    """A zero bias on ``chunk``'s output layer (its last pipeline stage; nothing elsewhere), to be loaded."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if not getattr(chunk, "post_process", False):
        return
    layer = chunk.output_layer
    anchor = next(chunk.parameters())  # NOTE: the weight is absent on a tied first stage
    bias = torch.nn.Parameter(torch.zeros(layer.output_size_per_partition, dtype=chunk.config.params_dtype,
                                          device=anchor.device))
    set_tensor_model_parallel_attributes(bias, True, 0, 1)
    bias.allreduce = True  # NOTE: as ColumnParallelLinear marks its own bias (megatron's DDP reads it)
    layer.bias = bias
    layer._forward_impl = types.MethodType(_bias_after_frozen_weight, layer)


def _bias_after_frozen_weight(layer, input, weight, *args, bias=None, **kwargs):
    """megatron's ``_forward_impl``, except beside a frozen weight a trained bias is added after the GEMM: megatron's
    frozen-weight function (``linear_with_frozen_weight``) adds it inside and returns it no gradient."""
    if weight.requires_grad or bias is None or not bias.requires_grad:
        return type(layer)._forward_impl(layer, input, weight, *args, bias=bias, **kwargs)
    return type(layer)._forward_impl(layer, input, weight, *args, bias=None, **kwargs) + bias


def _pass_hidden_states(layer, input_, weight=None, runtime_gather_output=None, **unused):
    """Stands in for the output layer's ``forward``: ``(hidden states [s, b, h], None)``, gathered under SP."""
    if getattr(layer, "sequence_parallel", False):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # NOTE: backward keeps this rank's slice: linear_cross_entropy already all-reduced the gradient over TP.
        input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False,
                                                      group=getattr(layer, "tp_group", None))
    return input_, None


def _rows_forward(forward, rows: slice | torch.Tensor, input_, *args, **kwargs):
    return forward(input_[rows], *args, **kwargs)


def hidden_states_out(chunks):
    """Inside, the language models of ``chunks`` return their final hidden states ``[b, s, h]`` instead of logits."""
    return _output_layers_patched(chunks, lambda layer: types.MethodType(_pass_hidden_states, layer))


def head_rows(chunks, rows: slice | torch.Tensor | None):
    """Inside, the output layers of ``chunks`` compute the logits of positions ``rows`` (a slice or an index of the
    layer's input rows) only (None: all; see the module docstring for where the caller may ask for it)."""
    return _output_layers_patched(chunks if rows is not None else [],
                                  lambda layer: functools.partial(_rows_forward, layer.forward, rows))


@contextlib.contextmanager
def _output_layers_patched(chunks, make_forward):
    """Inside, the output layer of each language model of ``chunks`` runs ``make_forward(layer)`` (an instance
    attribute; what the instance had before comes back at the end)."""
    layers = [head.output_layer for head in (language_head(c) for c in chunks) if head is not None]
    saved = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = make_forward(layer)
    try:
        yield
    finally:
        for layer, old in zip(layers, saved):
            if old is None:
                del layer.forward
            else:
                layer.forward = old
