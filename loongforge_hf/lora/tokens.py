"""PEFT's ``trainable_token_indices`` on megatron's embedding, and the embedding layers an adapter carries when the
vocabulary was resized (TRL's ``clone_chat_template`` does both: it resizes, then trains the added tokens' rows).

Choices:
- As PEFT's ``TrainableTokensWrapper``: the embedding rows of the listed tokens are replaced by a trainable
  ``[n, H]`` tensor (``trainable_tokens_delta``, initialised to those rows; despite its name it holds the rows, not a
  difference), the rest of the embedding stays frozen. Here the tensor is whole on every tensor-parallel rank of the
  first pipeline stage (n is small) and the embedding module's output rows of those tokens are replaced after it runs
  (a forward hook; under sequence parallelism this rank's sequence slice, the tensor's gradient then all-reduced over
  TP by megatron like a norm's). The replacement is exact (``torch.where``), as PEFT's ``index_copy``.
- The pad token's row (where transformers' embedding has ``padding_idx``: ``bridges/embedding_padding.py``) takes
  no gradient from lookups, as PEFT passes the base embedding's ``padding_idx`` to its ``F.embedding``; a tied LM
  head's gradient to it stays.
- With tied embeddings PEFT's LM head uses the same rows: the output layer's weight (in the logits' GEMM and in the
  fused loss, ``runtime.output_weight``) is the embedding with those rows replaced (``index_copy``, as PEFT), on this
  TP rank's vocabulary slice. Not under pipeline parallelism (the last stage's copy of the embedding would need its
  own rows kept equal to the first stage's): refused there with a message, as is an entry naming another layer than
  the embedding (an ``lm_head`` entry: PEFT wraps the LM head on its own then).
- Adapter files as PEFT writes them: ``base_model.model.<embedding>.token_adapter.trainable_tokens_delta``; and where
  the vocabulary differs from the source's config (resized since load), the whole embedding and LM head
  (``base_model.model.<embedding>.weight``, ``.token_adapter.base_layer.weight`` when wrapped, and
  ``base_model.model.lm_head.weight``, written for a tied model too), which PEFT writes so that the added tokens'
  rows survive; loading such a file needs the model resized to its vocabulary first, as with PEFT.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from loongforge_hf.bridges.output_layer import _pass_hidden_states
from loongforge_hf.lora.plan import LoraConfigError

DELTA = "token_adapter.trainable_tokens_delta"


def token_indices_of(config, bridge, embedding_name: str) -> tuple[int, ...]:
    """The token indices ``config.trainable_token_indices`` trains (empty when unset); refused with a message where
    PEFT would do something this implementation does not."""
    spec = config.trainable_token_indices
    if not spec:
        return ()
    if isinstance(spec, dict):
        others = [name for name in spec if not (embedding_name == name or embedding_name.endswith("." + name))]
        if others or len(spec) != 1:
            raise LoraConfigError(f"trainable_token_indices={spec}: only the input embedding ({embedding_name}) is "
                                  f"supported; {others or sorted(spec)} would wrap another layer (the LM head).")
        (spec,) = spec.values()
    indices = tuple(spec)
    vocab = bridge.hf_config.vocab_size
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab]
    if bad or len(set(indices)) != len(indices):
        raise LoraConfigError(f"trainable_token_indices: {bad or 'repeated indices'}: expected distinct token ids in "
                              f"[0, {vocab}).")
    saved = config.modules_to_save or []
    if any(embedding_name.endswith(m) for m in saved):
        raise LoraConfigError(f"The embedding layer is already trained fully (modules_to_save={saved}); give either "
                              "modules_to_save or trainable_token_indices for it, not both (as PEFT).")
    return indices


class TrainableTokens(nn.Module):
    """The trainable rows of the listed tokens (``trainable_tokens_delta``, ``[n, H]``) and where each token's row is
    (``slot``: a token's position in the list, -1 for the others)."""

    def __init__(self, indices: tuple[int, ...], rows: torch.Tensor, *, vocab_rows: int, sequence_parallel: bool,
                 padding_idx: int | None = None):
        super().__init__()
        self.indices = indices
        # NOTE: the pad token's position in the list (its row takes no lookup gradient), or None
        self.pad_slot = indices.index(padding_idx) if padding_idx in indices else None
        self.trainable_tokens_delta = nn.Parameter(rows)
        # NOTE: under sequence parallelism each TP rank replaces its sequence slice only: megatron all-reduces the
        # gradients of parameters marked so over TP (as a norm's)
        self.trainable_tokens_delta.sequence_parallel = sequence_parallel
        slot = torch.full((vocab_rows,), -1, dtype=torch.long, device=rows.device)
        slot[list(indices)] = torch.arange(len(indices), device=rows.device)
        self.register_buffer("slot", slot, persistent=False)
        # NOTE: this TP rank's rows of a vocabulary-parallel weight and the trained rows they take (tied LM head)
        from megatron.core import parallel_state as ps

        slots, local = _local_rows(indices, vocab_rows // ps.get_tensor_model_parallel_world_size())
        self.register_buffer("local_slots", torch.tensor(slots, dtype=torch.long, device=rows.device),
                             persistent=False)
        self.register_buffer("local_rows", torch.tensor(local, dtype=torch.long, device=rows.device),
                             persistent=False)

    def head_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A tied LM head's weight (this rank's ``[V_local, H]`` slice of the embedding) with the rows replaced."""
        if self.__dict__.get("lora_disabled"):
            return weight
        rows = self.trainable_tokens_delta
        if not rows.sequence_parallel:
            # NOTE: each TP rank's LM head gives the gradient of its own vocabulary rows: summed over TP here (identity
            # forward, all-reduce backward); under SP megatron all-reduces the whole gradient (embedding shares too)
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            if ps.get_tensor_model_parallel_world_size() > 1:
                rows = copy_to_tensor_model_parallel_region(rows)
        return weight.index_copy(0, self.local_rows, rows[self.local_slots].to(weight.dtype))

    def replace(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``embeddings`` ([s, b, H], or this rank's sequence slice under SP) with the listed tokens' rows replaced."""
        if self.__dict__.get("lora_disabled"):  # NOTE: inside disable_adapter() (unload.py)
            return embeddings
        position = self.slot[input_ids].transpose(0, 1).contiguous()  # [s, b]
        if embeddings.shape[0] != position.shape[0]:  # NOTE: sequence parallel: this rank's slice
            from megatron.core import parallel_state as ps

            start = ps.get_tensor_model_parallel_rank() * embeddings.shape[0]
            position = position[start:start + embeddings.shape[0]]
        table = self.trainable_tokens_delta
        if self.pad_slot is not None:
            table = torch.cat([table[:self.pad_slot], table[self.pad_slot:self.pad_slot + 1].detach(),
                               table[self.pad_slot + 1:]])
        rows = table[position.clamp(min=0)].to(embeddings.dtype)
        return torch.where((position >= 0).unsqueeze(-1), rows, embeddings).contiguous()


def _replace_output(module, args, kwargs, output):
    input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
    return module.token_adapter.replace(input_ids, output)


def _tied_head_weight(adapter: TrainableTokens, layer, args, kwargs):
    """The output layer's ``weight`` argument (the tied embedding's) with the trained rows, but where the layer's
    forward is the fused loss's stand-in (``output_layer.hidden_states_out``: the loss takes ``runtime.output_weight``
    instead, which applies them too)."""
    patched = layer.__dict__.get("forward")
    if kwargs.get("weight") is None or getattr(patched, "__func__", None) is _pass_hidden_states:
        return None
    return args, {**kwargs, "weight": adapter.head_weight(kwargs["weight"])}


def _local_rows(indices: tuple[int, ...], per_rank: int) -> tuple[list[int], list[int]]:
    """(positions in ``indices``, rows in this TP rank's slice) of the listed tokens that fall in that slice of a
    vocabulary-parallel weight of ``per_rank`` rows a rank."""
    from megatron.core import parallel_state as ps

    start = ps.get_tensor_model_parallel_rank() * per_rank
    local = [(k, i - start) for k, i in enumerate(indices) if start <= i < start + per_rank]
    return [k for k, _ in local], [r for _, r in local]


def embedding_rows(weight: torch.Tensor, indices: tuple[int, ...]) -> torch.Tensor:
    """The rows ``indices`` of a vocabulary-parallel ``weight`` (this rank's slice), whole on every TP rank."""
    from megatron.core import parallel_state as ps

    rows = weight.new_zeros(len(indices), weight.shape[1])
    slots, local = _local_rows(indices, weight.shape[0])
    rows[slots] = weight[local]
    if ps.get_tensor_model_parallel_world_size() > 1:  # NOTE: one rank holds each row, the others add zeros
        dist.all_reduce(rows, group=ps.get_tensor_model_parallel_group())
    return rows


def attach_trainable_tokens(model, indices: tuple[int, ...], rows: torch.Tensor | None = None) -> None:
    """Give the first pipeline stage's embedding a ``TrainableTokens`` (rows: the embedding's own, or ``rows``)."""
    for chunk in model.chunks:
        if not getattr(chunk, "pre_process", False):
            continue
        weight = chunk.embedding.word_embeddings.weight
        with torch.no_grad():
            start = embedding_rows(weight.detach(), indices) if rows is None else rows
        adapter = TrainableTokens(indices, start.to(device=weight.device, dtype=weight.dtype).clone(),
                                  vocab_rows=model.megatron.padded_vocab,
                                  sequence_parallel=bool(chunk.config.sequence_parallel),
                                  padding_idx=getattr(chunk.embedding.word_embeddings, "padding_idx", None))
        chunk.embedding.token_adapter = adapter
        chunk.embedding.register_forward_hook(_replace_output, with_kwargs=True)
        if getattr(chunk, "share_embeddings_and_output_weights", False) and getattr(chunk, "post_process", False):
            chunk.output_layer.register_forward_pre_hook(functools.partial(_tied_head_weight, adapter),
                                                         with_kwargs=True)


def remove_token_hooks(chunk) -> None:
    """Remove what ``attach_trainable_tokens`` hooked onto ``chunk`` (found by function, not by a stored handle: a
    handle of a ``copy.deepcopy``-ed model would still point at the original's hooks)."""
    for module, kind, ours in ((getattr(chunk, "embedding", None), "_forward_hooks", _replace_output),
                               (getattr(chunk, "output_layer", None), "_forward_pre_hooks", _tied_head_weight)):
        hooks = getattr(module, kind, {})
        for key in [k for k, f in hooks.items() if f is ours or getattr(f, "func", None) is ours]:
            del hooks[key]
            getattr(module, kind + "_with_kwargs").pop(key, None)


def check_tied_layout(model, indices: tuple[int, ...]) -> None:
    """Refuse (every rank alike, before any change) trainable tokens of a tied model under pipeline parallelism."""
    if indices and model.bridge.tied and model.parallel.pipeline_parallel_size > 1:
        raise LoraConfigError(f"trainable_token_indices on a model with tied embeddings is not supported with "
                              f"pipeline_parallel_size={model.parallel.pipeline_parallel_size} (the last stage's copy "
                              "of the embedding, the LM head, would need the trained rows too); use "
                              "pipeline_parallel_size=1 or train the model fully.")


def token_embeddings(model) -> list:
    """The embedding modules of ``model`` that carry a ``TrainableTokens`` (the first stage's)."""
    return [c.embedding for c in model.chunks
            if getattr(c, "pre_process", False) and "token_adapter" in c.embedding._modules]


def merged_token_rows(model):
    """(embedding weight, local row indices, their trained rows) on this rank, for the merged export."""
    for embedding in token_embeddings(model):
        adapter = embedding.token_adapter
        if adapter.local_rows.numel():
            yield (embedding.word_embeddings.weight, adapter.local_rows,
                   adapter.trainable_tokens_delta[adapter.local_slots])


def vocab_resized(model) -> bool:
    """Whether the vocabulary differs from the source's config (PEFT then writes the embedding layers)."""
    at_load = model._config_at_load.get("vocab_size")
    return at_load is not None and at_load != model.config.vocab_size


def peft_names(plan, tied: bool) -> dict[str, str]:
    """{HF parameter: its name in a PEFT adapter file} of the embedding layers written with a resized vocabulary or a
    LoRA adapter on the embedding (a tied LM head is wrapped like the embedding when tokens are trained; PEFT then
    writes its rows too: ``tied_head_delta``)."""
    wrapped, embedding_name = bool(plan.token_indices), plan.embedding_name
    # NOTE: an embedding with a LoRA adapter is PEFT's lora.Embedding around it (lora/embedding.py)
    base = "token_adapter.base_layer.weight" if wrapped else "base_layer.weight" if any(
        t.kind == "embedding" for t in plan.targets) else "weight"
    # NOTE: an untied LM head with a LoRA adapter is PEFT's lora.Linear around it (lora/head.py)
    head = "base_layer." if any(t.kind == "head" for t in plan.targets) else ""
    return {f"{embedding_name}.weight": f"base_model.model.{embedding_name}.{base}",
            "lm_head.weight": f"base_model.model.lm_head.{base if tied else head + 'weight'}",
            "lm_head.bias": f"base_model.model.lm_head.{head}bias"}  # NOTE: Phi's; PEFT writes all of lm_head


def tied_head_delta(plan, tied: bool, resized: bool) -> str | None:
    """The name PEFT writes a tied LM head's copy of the trained rows under (with a resized vocabulary), or None."""
    return "base_model.model.lm_head." + DELTA if plan.token_indices and tied and resized else None
