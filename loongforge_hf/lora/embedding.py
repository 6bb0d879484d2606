"""LoRA on the input token embedding (PEFT's ``lora.Embedding``: ``target_modules=["embed_tokens"]``) on megatron's
vocab-parallel embedding.

Choices:
- PEFT's math: ``out = E[x] + scaling * A^T[x] @ B^T`` with ``lora_embedding_A`` ``[r, vocab]`` and
  ``lora_embedding_B`` ``[hidden, r]``; no dropout (PEFT's embedding layer applies none); the lookup into A passes the
  embedding's ``padding_idx`` (the pad token's column takes no gradient), as PEFT's ``_embed``. An embedding scaled
  after the lookup (Gemma's ``sqrt(hidden)``) scales the adapter's term too, as PEFT's ``embed_scale``.
- Megatron's ``VocabParallelEmbedding`` is re-classed to ``LoraVocabParallelEmbedding`` (unloading re-classes to
  ``__mro__[1]``): A holds this rank's vocabulary columns (of the padded vocabulary: the padding's columns zero and
  never looked up), B is whole on every rank. Each rank adds its partial ``A_r^T[x] @ B^T`` (zero for tokens outside
  its vocabulary) to its partial lookup before megatron's all-reduce (reduce-scatter under sequence parallelism),
  which sums both; B enters through ``copy_to_tensor_model_parallel_region``, so its gradient sums the ranks'.
  This forward stands in for megatron-core 0.16.1 tensor_parallel/layers.py:268-301 (``VocabParallelEmbedding
  .forward``) with the adapter's term; the pad token's row of the base lookup is detached there (what
  ``bridges/embedding_padding`` does with a hook, which skips a module with adapters: the adapter's term at the pad
  token keeps its gradient to B, as PEFT's).
- Initial factors (``init.py``): PEFT's ``torch.randn`` of A then B, then, unless ``init_lora_weights=False``, A zeroed
  and B redrawn from a standard normal (``"gaussian"`` / ``"orthogonal"`` alike, as PEFT's embedding layer does).
- Merging adds ``scaling * (B @ A)^T`` to this rank's rows of the weight (a tied LM head sees it, as in PEFT).
- Adapter files: ``base_model.model.<embedding>.lora_embedding_A`` / ``lora_embedding_B`` (PEFT's names), A trimmed to
  the vocabulary. Training checkpoints: A sharded over TP along the vocabulary as the weight (shape mismatch allowed
  as for the weight: the padding depends on the TP size), B replicated.
- Refused by name (``check_embedding_options``): DoRA, PiSSA / OLoRA, ``trainable_token_indices`` with it (not
  compared with PEFT). With ``modules_to_save`` naming it, PEFT trains the embedding whole and adapts nothing there;
  so does the planner (PEFT's own matching); an image-text model's embedding is no target here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from torch import nn


class LoraVocabParallelEmbedding(VocabParallelEmbedding):
    """megatron's ``VocabParallelEmbedding`` plus PEFT's embedding adapter (``lora``: one, keyed by the HF name)."""

    lora: nn.ModuleDict

    def forward(self, input_):
        tp = self.tp_group.size()
        masked, outside = input_, None
        if tp > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked = input_.clone() - self.vocab_start_index
            masked[outside] = 0
        out = F.embedding(masked, self.weight)
        pad = getattr(self, "padding_idx", None)
        if pad is not None and out.requires_grad:  # NOTE: embedding_padding's rule, before the adapter's term
            out = torch.where((input_ == pad).unsqueeze(-1), out.detach(), out)
        if not self.__dict__.get("lora_disabled"):
            local_pad = None if pad is None or not self.vocab_start_index <= pad < self.vocab_end_index else \
                pad - self.vocab_start_index
            for adapter in self.lora.values():
                b = copy_to_tensor_model_parallel_region(adapter.B, group=self.tp_group) if tp > 1 else adapter.B
                after_a = F.embedding(masked, adapter.A.t(), padding_idx=local_pad)
                out = out + ((after_a @ b.t()) * adapter.scaling).to(out.dtype)
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)

    @torch.no_grad()
    def lora_merge_delta(self) -> torch.Tensor:
        """What merging adds to this rank's rows of the weight (float32): ``scaling * (B @ A_r)^T``."""
        return sum((a.B.float() @ a.A.float()).t() * a.scaling for a in self.lora.values())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        groups = dict(tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, adapter in self.lora.items():
            key = f"{prefix}lora.{name}."
            out[key + "A"] = make_tp_sharded_tensor_for_checkpoint(  # NOTE: the vocabulary axis, as the weight's
                tensor=adapter.A, key=key + "A", tp_axis=1, allow_shape_mismatch=True, prepend_offsets=sharded_offsets,
                **groups)
            out.update(make_sharded_tensors_for_checkpoint({"B": adapter.B}, key, {}, sharded_offsets, **groups))
        return out


def attach_embedding(module: nn.Module, adapters: dict) -> None:
    """Turn megatron's ``VocabParallelEmbedding`` ``module`` into ``LoraVocabParallelEmbedding`` with ``adapters``."""
    check_embedding_adaptable(module)
    module.__class__ = LoraVocabParallelEmbedding
    module.lora = nn.ModuleDict(adapters)


def check_embedding_adaptable(module: nn.Module) -> None:
    """``TypeError`` unless ``module`` is megatron's plain ``VocabParallelEmbedding`` (before anything changes)."""
    if type(module) is not VocabParallelEmbedding:
        raise TypeError(f"LoRA on the token embedding expects megatron's VocabParallelEmbedding; got "
                        f"{type(module).__name__}.")


def local_columns(a: torch.Tensor, *, padded_vocab: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's vocabulary columns of A ``[r, vocab]``, the padded vocabulary's columns zero."""
    per = padded_vocab // tp_size
    full = torch.zeros(a.shape[0], padded_vocab, dtype=a.dtype)
    full[:, :a.shape[1]] = a
    return full[:, tp_rank * per:(tp_rank + 1) * per]


def check_embedding_options(config, targets, token_indices) -> None:
    """Refuse, by name, what LoRA on the embedding does not cover here (pure, every rank alike)."""
    from loongforge_hf.lora.init import refuse_unverified

    refuse_unverified(config, sorted({t.hf_module for t in targets if t.kind == "embedding"}), "the token embedding",
                      "the embedding", ("trainable_token_indices",) if token_indices else ())
