"""NEFTune (``TrainingArguments.neftune_noise_alpha``) on megatron's embedding, as transformers.Trainer applies it.

Choices:
- transformers adds ``uniform(-m, m)`` noise, ``m = alpha / sqrt(L * H)``, to the input embeddings' output while the
  model trains (a forward hook on ``get_input_embeddings()``), with ``L`` the batch's sequence length as the collator
  made it and ``H`` the hidden size. Here the hook sits on megatron's embedding (the first pipeline stage's; in
  Qwen2.5-VL the text embedding, before the images take their rows, as transformers' ``embed_tokens``), and ``L`` is
  the micro-batch's length before the engine pads it for the layout (``set_length``; without one, the padded length).
- The noise is drawn as transformers draws it: one ``[batch, L, H]`` tensor of the embedding's dtype from the default
  generator of its device. Every rank of a tensor- and context-parallel group draws the same tensor (their default
  generators move together, as megatron's embedding dropout without sequence parallelism assumes) and adds its own
  rows: its context-parallel share, then its sequence-parallel part (``local_token_positions``). So the noise does
  not depend on the layout, and a one-process run adds transformers' numbers. The cost: each rank draws the whole
  micro-batch's noise (what one GPU under transformers draws), a transient tensor of the embeddings' global size.
- Only while the module trains (evaluation adds none), and only inside ``train()``: ``remove()`` takes the hooks off.
"""

from __future__ import annotations

import torch


class NoisyEmbeddings:
    """Forward hooks adding NEFTune noise to the outputs of megatron ``LanguageModelEmbedding`` modules."""

    def __init__(self, chunks, *, alpha: float) -> None:
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

        if alpha < 0:
            raise ValueError(f"neftune_noise_alpha must be >= 0, got {alpha}.")
        self.alpha = float(alpha)
        self.length: int | None = None
        modules = [m for chunk in chunks for m in chunk.modules() if isinstance(m, LanguageModelEmbedding)]
        self._handles = [m.register_forward_hook(self._add_noise) for m in modules]

    def set_length(self, length: int | None) -> None:
        """The sequence length of the micro-batch about to run, as its collator made it (transformers' ``L``)."""
        self.length = length

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _add_noise(self, module, args, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        from megatron.core import parallel_state as ps

        from loongforge_hf.parallel.context_parallel import local_token_positions

        local, batch, hidden = output.shape  # NOTE: megatron's [s, b, h]
        tp = ps.get_tensor_model_parallel_world_size() if module.config.sequence_parallel else 1
        cp = ps.get_context_parallel_world_size()
        total = local * tp * cp
        length = total if self.length is None else self.length
        if not 0 < length <= total:
            raise ValueError(f"NEFTune: micro-batch length {length} does not fit the embedded sequence ({total}).")
        # NOTE: transformers' numbers: the magnitude through a float32 tensor, then one uniform_ over [b, L, h]
        magnitude = float(self.alpha / torch.sqrt(torch.tensor(length * hidden)))
        noise = torch.zeros(batch, length, hidden, dtype=output.dtype, device=output.device)
        noise = noise.uniform_(-magnitude, magnitude).transpose(0, 1)
        if length < total:  # NOTE: the layout's pad positions (masked out of attention and loss) get none
            noise = torch.cat([noise, noise.new_zeros(total - length, batch, hidden)])
        if total > local:
            noise = noise[local_token_positions(total, cp_size=cp, cp_rank=ps.get_context_parallel_rank(), sp_size=tp,
                                                sp_rank=ps.get_tensor_model_parallel_rank(), device=noise.device)]
        return output + noise
