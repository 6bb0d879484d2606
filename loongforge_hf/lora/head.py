"""LoRA on an untied LM head (``target_modules=[..., "lm_head"]``: PEFT's ``lora.Linear`` on ``lm_head``) on
megatron's vocab-parallel output layer.

Choices:
- PEFT's math: ``logits = lm_head(x) + scaling * B(A(dropout(x)))``, A ``[r, hidden]`` whole on every rank, B
  ``[vocab, r]`` split over TP by the vocabulary rows as the weight (megatron's padded vocabulary: the padding's rows
  zero, and they never take a gradient: the losses mask those logits).
- Where logits are made (evaluation, ``generate``, ``logits_to_keep``) the output layer is LoRA's
  ``LoraColumnParallelLinear`` like any column-parallel target (one slot of this rank's vocabulary rows,
  ``layers.py``). Where the loss is fused with the head (training, DPO, the online trainers: the output layer passes
  the hidden states through), the loss adds ``z @ B^T`` to each chunk's logits with ``z = scaling * dropout(x) @
  A^T`` made once from the hidden states it reads (``kernels.cross_entropy``'s ``low_rank``), so the frozen
  ``[vocab, hidden]`` weight never gets an effective copy or a gradient. Those hidden states are every position on
  every TP rank (gathered under sequence parallelism), so ``z`` is too; its gradient is all-reduced over TP inside
  the loss, which leaves A's the full sum on each rank (dropout masks from the default generator, alike on the TP
  ranks, as ``layers.py`` draws them for a replicated input).
- Refused, by name: an LM head tied to the input embedding (``tie_word_embeddings``: PEFT itself warns that its
  adapter there has no tied counterpart and merging changes the embedding too); DoRA and PiSSA / OLoRA on the head
  (not compared with PEFT); an image-text model's LM head.
- Adapter files: ``base_model.model.lm_head.lora_A.weight`` / ``lora_B.weight`` (B trimmed to the vocabulary) and the
  head's ``base_layer.weight``, which PEFT writes when an embedding layer (``lm_head`` is one to it) is targeted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def low_rank_term(lora, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``scaling * dropout(hidden) @ A^T`` ``[N, r]``, B ``[V_local, r]``) of the output layer's one adapter."""
    (adapter,) = lora.values()
    z = F.linear(adapter.drop(hidden, input_is_split=False), adapter.A) * adapter.scaling
    return z, adapter.B


def check_head_options(config, targets) -> None:
    """Refuse, by name, what LoRA on the LM head does not cover here (pure, every rank alike)."""
    from loongforge_hf.lora.init import refuse_unverified

    refuse_unverified(config, sorted({t.hf_module for t in targets if t.kind == "head"}), "the LM head", "lm_head")


TIED_HEAD = ("the LM head is tied to the input embedding (tie_word_embeddings=True): PEFT's adapter there has no "
             "counterpart on the embedding and merging it changes the embedding too (PEFT warns so); adapt the "
             "embedding the head reads instead (target_modules=['embed_tokens', ...]), or load a checkpoint whose "
             "head is untied")
