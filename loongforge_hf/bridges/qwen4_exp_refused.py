"""Qwen4-Exp refused by name (``registry.refuse_architectures``): its text model
(``Qwen4ExpForCausalLM``, ``model_type="qwen4_exp_text"``) and the image-text one
(``Qwen4ExpForConditionalGeneration``, ``model_type="qwen4_exp"``, which ``lf.AutoModelForCausalLM`` would load as
transformers' ``AutoModelForCausalLM`` does).

Choices:
- What maps to existing pieces (``docs/index.md`` has the triage): Qwen3.5's Gated DeltaNet layers
  (``gated_deltanet.py``; a ``sigmoid`` ``output_gate_type`` would be one option of its gated norm), its gated
  full attention with zero-centred q / k norms and partial rotary (text positions only), Qwen3.5-MoE's softmax top-k
  experts with a sigmoid-gated shared expert and ``norm_topk_prob`` (``qwen3_5_moe.py`` / ``qwen3_next.py``).
- What is new, each a layer this package does not have, listed in the refusal:
  - the gated hyper-connection residual (``Qwen4ExpTextGatedResidual``): ``hc_count`` streams, a per-stream
    zero-centred RMS norm, a low-rank sigmoid mixer averaged over the streams as each sublayer's input, ``2 *
    sigmoid`` injection weights back into every stream, the model's ``hyper_connection_mixer`` in place of a final
    norm, and no input / pre-MLP norms. DeepSeek-V4's and HY-V4's hyper-connections (``deepseek_v4_layer.py``)
    carry the ``[s, b, hc * H]`` streams through megatron's layers but compute other formulas;
  - the QSA indexer of the attention layers (``Qwen4ExpTextQSAIndexer``): per query, the visible keys in blocks of
    ``indexer_compress_ratio``, each block's mean key normed and rotated at its first position, scored by the sum
    over ``indexer_n_heads`` query heads of ReLU dot products, the top ``indexer_budget / indexer_compress_ratio``
    blocks plus the incomplete tail kept as a mask on the attention. megatron's DSA indexer
    (``sparse_attention.py``) scores single tokens with learned per-head weights;
  - per-layer embeddings on ``ple_layer_ids`` (``Qwen4ExpTextPLELayer``): hashed n-gram ids (seeded multipliers,
    XOR, prime-sized tables per head, history cut at ``eos_token_id``), tables of ``ngram_vocab_size_base`` (20M)
    rows per head stored in ``split_ngram_parts`` shards on disk, key / value projections gating every stream, a
    dilated depthwise conv. Gemma 4's per-layer inputs (``gemma4_per_layer.py``) are one token-id table.
"""

from __future__ import annotations

from loongforge_hf.bridges.registry import refuse_architectures

QWEN4_EXP = ("it needs three kinds of layer not built here: the gated hyper-connection residual (hc_count streams, "
             "a low-rank sigmoid mixer as each sublayer's input, 2 * sigmoid injection into every stream, the "
             "hyper_connection_mixer for a final norm), the QSA indexer (mean-pooled key blocks of "
             "indexer_compress_ratio tokens scored by summed ReLU dot products, the top indexer_budget tokens' "
             "blocks as an attention mask; megatron's DSA indexer scores single tokens) and per-layer n-gram "
             "embeddings (ple_layer_ids: hashed n-gram tables sharded in split_ngram_parts, stream gates, a dilated "
             "conv)")
refuse_architectures(QWEN4_EXP, "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
