"""The pad token's embedding row as transformers trains it. Most HF decoders build their token embedding as
``nn.Embedding(vocab_size, hidden_size, padding_idx=config.pad_token_id)`` (Llama, Qwen, Mistral, Gemma's scaled
embedding, DeepSeek, ... and the language model of every image-text model here), and ``nn.Embedding`` gives that row
no gradient from lookups; megatron's ``VocabParallelEmbedding`` gives it one. Wherever the pad id is a real input
token (pad == eos in many tokenizers, a sampled pad in GRPO, packed sequences), training would otherwise differ.

Choices:
- Which row: the text config's ``pad_token_id``, as transformers reads it (the config's, not the tokenizer's; an
  image-text model's ``text_config``'s), a negative one counted from the end of the vocabulary as ``nn.Embedding``
  counts it; none for the model types whose HF model passes no ``padding_idx`` (``UNPADDED``).
  tests/bridges/test_embedding_padding.py checks this against transformers' own model of every supported
  architecture. A pad id outside the vocabulary (which transformers cannot build) raises ``ValueError`` naming it.
- How: a forward hook on the first pipeline stage's ``VocabParallelEmbedding`` (``padding_idx``: the global id)
  detaches its output where the input id is the pad id (under sequence parallelism: this rank's slice of the
  reduce-scattered output). That output is the row alone (summed over the TP ranks, of which one holds it), so only
  the lookup's gradient to the row goes, at every TP / SP / CP layout; a tied LM head keeps its gradient to the row
  (the same weight in one chunk, or the last pipeline stage's copy), as in transformers. Values are unchanged, and
  nothing runs where the output takes no gradient (inference, a frozen embedding). One elementwise select per step:
  megatron's lookup takes no ``padding_idx``, and a copy of its forward would have to follow megatron's.
- PEFT's trainable-token wrapper passes the base embedding's ``padding_idx`` to its lookup: ``lora/tokens.py`` reads
  the row from ``padding_idx`` here.
"""

from __future__ import annotations

import torch

# NOTE: HF model types whose token embedding is ``nn.Embedding(vocab_size, hidden_size)``, without padding_idx
# (transformers 5: GPT2Model, GPTBigCodeModel, GPTJModel, GPTNeoXModel, FalconModel, NemotronHModel, CodeGenModel,
# GPTNeoModel, GPTNeoXJapaneseModel)
UNPADDED = frozenset({"gpt2", "gpt_bigcode", "gptj", "gpt_neox", "falcon", "nemotron_h", "codegen", "gpt_neo",
                      "gpt_neox_japanese",
                      "mamba2", "mamba", "falcon_mamba"})


def embedding_padding_idx(bridge) -> int | None:
    """The row of ``bridge``'s token embedding (a text bridge's) that takes no gradient from lookups in transformers,
    or None."""
    config = bridge.hf_config
    pad = getattr(config, "pad_token_id", None)
    if pad is None or getattr(config, "model_type", None) in UNPADDED:
        return None
    vocab = config.vocab_size
    if isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab:
        raise ValueError(f"{type(config).__name__}.pad_token_id={pad!r}: transformers builds the token embedding with "
                         f"padding_idx=pad_token_id, which must be a token id in [-{vocab}, {vocab}) (vocab_size="
                         f"{vocab}); fix pad_token_id in config.json or set it to null.")
    return pad % vocab


def pad_without_lookup_gradient(embedding, padding_idx: int | None) -> None:
    """Give megatron's ``VocabParallelEmbedding`` ``embedding`` transformers' ``padding_idx`` (a global token id)."""
    embedding.padding_idx = padding_idx
    if padding_idx is not None:
        embedding.register_forward_hook(_detach_pad_rows)


def _detach_pad_rows(module, args, output: torch.Tensor):
    if not output.requires_grad or module.padding_idx is None or "lora" in module._modules:
        return None  # NOTE: with LoRA adapters the module detaches the base lookup's row itself (lora/embedding.py)
    pad = args[0] == module.padding_idx  # [b, s]
    if module.reduce_scatter_embeddings:  # NOTE: output [s / tp, b, h]: this TP rank's slice of the sequence
        from megatron.core.utils import get_pg_rank

        start = get_pg_rank(module.tp_group) * output.shape[0]
        # NOTE: contiguous, else the select takes the transposed mask's strides and later views of it fail
        pad = pad.t()[start:start + output.shape[0]].contiguous()
    return torch.where(pad.unsqueeze(-1), output.detach(), output)
