"""DeepseekV4ForCausalLM (DeepSeek-V4-Flash / -Pro): hyper-connected residual streams, three attention kinds (sliding
window, compressed sparse with a lightning indexer, heavily compressed), shared-KV MQA with sinks and a grouped
low-rank output projection, hash-routed then top-k routed experts with ``sqrtsoftplus`` scores and a clipped SwiGLU.

Choices:
- Each layer is ``deepseek_v4_layer.DeepseekV4Layer``: megatron's ``TransformerLayer`` (its input / pre-MLP norms and
  ``MoELayer`` from the MoE block spec) with our attention (``deepseek_v4_attention.py``) and transformers'
  hyper-connections; the decoder's final norm is the hyper-head plus ``model.norm`` (``Head``). No megatron rotary:
  the attention applies transformers' own frequencies (``position_embedding_type="none"``).
- Experts: the clamped SwiGLU (``activation_func_clamp_value`` = ``swiglu_limit``) in our grouped MLP
  (``kernels/clamped_glu.py``), or megatron's ``SequentialMLP`` under ``LOONGFORGE_MOE_GROUPED_GEMM=0``; the shared
  expert (``moe_intermediate_size`` wide, as transformers builds it) megatron's ``SharedExpertMLP``, clamped too.
  Routers: ``deepseek_v4_layer.route_topk`` / ``route_hash``.
- Layouts: TP splits the experts and the shared expert and needs sequence parallelism; attention and the
  hyper-connections stay replicated (transformers' own TP plan does the same). EP splits the experts. PP (virtual
  stages too): a stage boundary carries the ``hc_mult`` residual streams ``[s, b, hc_mult * H]``
  (``pipeline_hidden_size``, which ``stage_boundary`` turns into megatron's shape exchange); the first stage expands the
  embedding, the last has the hyper-head; the routers take their rule by the layer's global number. Activation
  recompute under PP is refused (``recompute_refusal``): a stage runs later micro-batches' forwards before an earlier
  one's backward, so a recomputed hash layer would route by another micro-batch's token ids.
- Tensor names are the checkpoint's as transformers 5 writes them (its ``conversion_mapping`` for ``deepseek_v4``:
  ``attn.wq_a`` / ``attn.q_norm`` / ``attn.wkv`` / ``attn.norm`` / ``attn.wo_a`` / ``attn.wo_b`` / ``attn.attn_sink``,
  ``attn.compressor.{wkv, wgate, ape, norm}``, ``attn.indexer.{compressor.*, wq_b, weights_proj}``,
  ``ffn.gate.{weight, bias, tid2eid}``, ``ffn.experts.E.w1 / w3 / w2``, ``hc_attn_*`` / ``hc_ffn_*``,
  ``model.hc_head.*``, ``head``). The hub's files name them without ``model.`` (``embed.weight``, ``layers.N.*``,
  ``norm.weight``, ``hc_head_fn``): read through ``checkpoint_aliases``, exported under transformers' names, as its
  ``save_pretrained`` does. The multi-token-prediction layers (``mtp.*``) are passed through (transformers does not
  build them). ``tid2eid`` is int64 on disk, here and on export (``TokenTable`` checks it).
- What transformers keeps in fp32 (hyper-connections and the hyper-head, sinks, position biases, the attention and
  final norms, the expert bias) is fp32 here and on export; the input / pre-MLP norms are megatron's (our RMSNorm), in
  the model's dtype (a bf16 model rounds transformers' fp32 weights and exports them in bf16).
- Context parallelism: each rank's queries over the whole sequence's keys and compressed entries
  (``deepseek_v4_attention``). Refused by name before any collective: TP without sequence parallelism (as for every
  MoE model), ``megatron_config`` ``variable_seq_lengths=False`` (the stage boundary needs it), ``generate`` with a
  KV cache (the compressors' running windows are not cached; ``use_cache=False`` runs), rope types other than
  default / YaRN, ``attention_dropout``, ``hidden_act`` other than silu, ``scoring_func`` other than
  ``sqrtsoftplus``, ``o_groups`` that do not split the heads. Packed documents (``position_ids`` other than
  ``0..s-1``) are refused on the whole batch (``check_position_ids``: the model's forward, LoongTrainer's batch
  check).
- LoRA (names: ``deepseek_v4_lora``): our attention's torch linears (``q_a_proj``, ``q_b_proj``, ``kv_proj``,
  ``o_b_proj``, the compressors' and the indexer's, whose adapters and ``modules_to_save`` stay frozen: no gradient,
  as in PEFT) carry whole adapters on every rank (``lora/replicated.py``), the shared experts megatron's, the routed
  experts and the routers (``target_parameters``) the grouped MLP's expert adapters and the re-classed routers';
  refused by name: the grouped ``o_a_proj`` (PEFT's layer fails on it), DoRA / PiSSA / OLoRA on the attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.checkpoint_files import CheckpointError
from loongforge_hf.bridges.checkpoint_io import IntegerShape
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import GatedMLP
from loongforge_hf.bridges.mappings import FP32Replicated, Mapping, Replicated, RowParallel, VocabParallel
from loongforge_hf.bridges.moe import EXPERT, MoEBridge
from loongforge_hf.bridges.registry import register_bridge

A, S = f"{L}.attn", f"{D}.self_attention"
ATTENTION = {"q_a_proj.weight": "wq_a.weight", "q_a_norm.weight": "q_norm.weight", "q_b_proj.weight": "wq_b.weight",
             "kv_proj.weight": "wkv.weight", "kv_norm.weight": "norm.weight", "o_a_proj.weight": "wo_a.weight",
             "o_b_proj.weight": "wo_b.weight", "sinks": "attn_sink"}
COMPRESSOR = {"kv_proj.weight": "wkv.weight", "gate_proj.weight": "wgate.weight", "position_bias": "ape",
              "kv_norm.weight": "norm.weight"}
HC = ("fn", "base", "scale")


@dataclass(frozen=True)
class TokenTable(Replicated):
    """A hash layer's ``tid2eid`` ``[vocab, k]``: int64 on disk and here, each entry an expert index."""

    hf_dtype = torch.int64
    experts: int = 0

    def load(self, reader, ctx, layer):
        table = super().load(reader, ctx, layer)
        if table.is_floating_point() or table.numel() and not 0 <= int(table.min()) <= int(table.max()) < \
                self.experts:
            raise CheckpointError(f"{self.hf.format(layer=layer)}: expected integer expert indices in [0, "
                                  f"{self.experts}), found {table.dtype} in [{table.min()}, {table.max()}].")
        return table.long()


@register_bridge("DeepseekV4ForCausalLM")
class DeepseekV4Bridge(MoEBridge):
    per_layer_types = True
    supports_sliding_window = True  # NOTE: in our attention module (no megatron window_size: kw below)
    hf_router_logits = True
    hf_balance_loss = True
    position_embedding_type = "none"
    has_passthrough = True
    lora_replicated_linears = True  # NOTE: LoRA on our attention's torch linears (lora/replicated.py)
    # NOTE: the hub's names, without model. (transformers adds it and renames embed / hc_head_*)
    checkpoint_aliases = ((r"^embed\.weight$", "model.embed_tokens.weight"), (r"^layers\.", "model.layers."),
                          (r"^norm\.weight$", "model.norm.weight"),
                          (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"))

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if c.scoring_func != "sqrtsoftplus":
            raise C.UnsupportedConfigError(f"scoring_func={c.scoring_func!r} is not supported for {arch} (only "
                                           "'sqrtsoftplus').")
        for label in ("main", "compress"):
            kind = c.rope_parameters[label]["rope_type"]
            if kind not in ("default", "yarn"):
                raise C.UnsupportedConfigError(f"rope_parameters[{label!r}] rope_type={kind!r} is not supported for "
                                               f"{arch} (default or yarn).")
        if c.attention_dropout:
            raise C.UnsupportedConfigError(f"attention_dropout={c.attention_dropout} is not supported for {arch}.")
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only silu).")
        if c.q_lora_rank is None or not c.o_groups or c.num_attention_heads * c.head_dim % c.o_groups:
            raise C.UnsupportedConfigError(f"o_groups={c.o_groups} does not split the {c.num_attention_heads} heads "
                                           f"of {arch}.")
        super().check_config()

    def check_position_ids(self, position_ids) -> None:
        """Refuse packed documents (the compressors would pool across them) on the whole batch (module docstring)."""
        if position_ids is not None and not torch.equal(position_ids.cpu(), torch.arange(
                position_ids.shape[-1]).expand_as(position_ids.cpu())):
            raise ValueError(f"position_ids other than 0..s-1 (packed documents) are not supported for "
                             f"{self.architectures[0]}: its compressors pool windows of the whole sequence.")

    def pipeline_hidden_size(self) -> int:
        """What a pipeline stage sends per token: the ``hc_mult`` residual streams (stage_boundary.py)."""
        return self.hf_config.hc_mult * self.hf_config.hidden_size

    def recompute_refusal(self, pipeline_parallel_size: int) -> str | None:
        """Activation recompute under pipeline parallelism: a stage runs later micro-batches' forwards before an
        earlier one's backward, and a hash layer recomputed there would route by the latest forward's token ids."""
        if pipeline_parallel_size > 1 and "hash_moe" in self.hf_config.mlp_layer_types:
            return (f"activation recompute with pipeline_parallel_size={pipeline_parallel_size} is not supported for "
                    f"{self.architectures[0]}: its hash-routed layers choose experts by the token ids of the "
                    "forward, which a recompute in the backward of an earlier micro-batch would not see.")
        return None

    def generation_refusal(self, generation_config) -> str | None:
        if generation_config.use_cache:
            return (f"a KV cache is not supported for {self.architectures[0]} (the compressors' running windows are "
                    "not cached); pass use_cache=False.")
        return None

    def rope_parameters(self) -> dict:
        return {"rope_type": "default", "rope_theta": self.hf_config.rope_theta}

    def num_experts(self) -> int:
        return self.hf_config.n_routed_experts

    def shared_ffn_size(self) -> int:
        return self.hf_config.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "sigmoid"}  # NOTE: unused: every router routes by its own rule

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.pop("num_query_groups", None)  # NOTE: megatron's attention is not built
        kw.pop("window_size", None)
        kw.update(activation_func_clamp_value=float(self.hf_config.swiglu_limit), glu_linear_offset=0.0)
        return kw

    def layer_module(self) -> type:
        from loongforge_hf.bridges.deepseek_v4_layer import v4_layer

        return v4_layer(self.hf_config)

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.deepseek_v4_layer import Head, attach_routing

        refusal = self.recompute_refusal(model.config.pipeline_model_parallel_size)
        if model.config.recompute_granularity is not None and refusal:  # NOTE: megatron_config's recompute
            raise ValueError(refusal)
        if model.post_process:
            model.decoder.final_layernorm = Head(self.hf_config, sequence_parallel=bool(model.config.sequence_parallel))
        attach_routing(model, self.hf_config)

    def checkpoint_name(self, name: str) -> str:
        """The LoRA planner's way from transformers' module names to the checkpoint's (``deepseek_v4_lora``)."""
        from loongforge_hf.bridges.deepseek_v4_lora import checkpoint_name

        return checkpoint_name(self, name)

    def passthrough_names(self, names) -> list[str]:
        """The checkpoint's multi-token-prediction tensors (``mtp.*``, ``model.layers.{num_hidden_layers + i}.*``)."""
        n = self.hf_config.num_hidden_layers
        return [x for x in names if x.startswith("mtp.") or x.startswith("model.layers.") and int(x.split(".")[2]) >= n]

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self, kind: str | None = None) -> list[Mapping]:
        maps: list[Mapping] = [Replicated(f"{D}.input_layernorm.weight", f"{L}.attn_norm.weight")]
        maps += [FP32Replicated(f"{D}.{hc}_hc.{x}", f"{L}.hc_{hc}_{x}") for hc in ("attn", "ffn") for x in HC]
        maps += [_replicated(f"{S}.{ours}", f"{A}.{theirs}") for ours, theirs in ATTENTION.items()]
        if kind in (None, "compressed_sparse_attention", "heavily_compressed_attention"):
            maps += [_replicated(f"{S}.compressor.{ours}", f"{A}.compressor.{theirs}")
                     for ours, theirs in COMPRESSOR.items()]
        if kind in (None, "compressed_sparse_attention"):
            x = f"{S}.compressor.indexer"
            maps += [_replicated(f"{x}.compressor.{ours}", f"{A}.indexer.compressor.{theirs}")
                     for ours, theirs in COMPRESSOR.items()]
            maps += [Replicated(f"{x}.q_b_proj.weight", f"{A}.indexer.wq_b.weight"),
                     Replicated(f"{x}.weights_proj.weight", f"{A}.indexer.weights_proj.weight")]
        return maps

    def moe_mappings(self, kind: str | None = None) -> list[Mapping]:
        s, local = f"{L}.ffn", f"{D}.mlp.experts.local_experts.{EXPERT}"
        routed = self.routed_mappings(
            GatedMLP(f"{local}.linear_fc1.weight", gate=f"{s}.experts.{EXPERT}.w1.weight",
                     up=f"{s}.experts.{EXPERT}.w3.weight"),
            RowParallel(f"{local}.linear_fc2.weight", f"{s}.experts.{EXPERT}.w2.weight"))
        maps: list[Mapping] = [
            Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.ffn_norm.weight"),
            Replicated(f"{D}.mlp.router.weight", f"{s}.gate.weight"), *routed,
            GatedMLP(f"{D}.mlp.shared_experts.linear_fc1.weight", gate=f"{s}.shared_experts.w1.weight",
                     up=f"{s}.shared_experts.w3.weight"),
            RowParallel(f"{D}.mlp.shared_experts.linear_fc2.weight", f"{s}.shared_experts.w2.weight")]
        if kind in (None, "hash_moe"):
            maps.append(TokenTable(f"{D}.mlp.router.tid2eid", f"{s}.gate.tid2eid",
                                   experts=self.hf_config.n_routed_experts))
        if kind in (None, "moe"):
            maps.append(FP32Replicated(f"{D}.mlp.router.expert_bias", f"{s}.gate.bias"))
        return maps

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.moe_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        c = self.hf_config
        return self.attention_mappings(c.layer_types[layer]) + self.moe_mappings(c.mlp_layer_types[layer])

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", "model.embed_tokens.weight")

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [FP32Replicated("decoder.final_layernorm.weight", "model.norm.weight")]
        maps += [FP32Replicated(f"decoder.final_layernorm.hc_{x}", f"model.hc_head.hc_{x}") for x in HC]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", "head.weight"))
        return maps

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"model.layers.{layer}"
        h, hd, n, e, f = c.hidden_size, c.head_dim, c.hc_mult, c.n_routed_experts, c.moe_intermediate_size
        a, kind = f"{p}.attn", c.layer_types[layer]
        shapes = {f"{p}.attn_norm.weight": (h,), f"{p}.ffn_norm.weight": (h,),
                  f"{a}.wq_a.weight": (c.q_lora_rank, h), f"{a}.q_norm.weight": (c.q_lora_rank,),
                  f"{a}.wq_b.weight": (c.num_attention_heads * hd, c.q_lora_rank), f"{a}.wkv.weight": (hd, h),
                  f"{a}.norm.weight": (hd,), f"{a}.attn_sink": (c.num_attention_heads,),
                  f"{a}.wo_a.weight": (c.o_groups * c.o_lora_rank, c.num_attention_heads * hd // c.o_groups),
                  f"{a}.wo_b.weight": (h, c.o_groups * c.o_lora_rank)}
        for hc in ("attn", "ffn"):
            shapes.update({f"{p}.hc_{hc}_fn": ((2 + n) * n, n * h), f"{p}.hc_{hc}_base": ((2 + n) * n,),
                           f"{p}.hc_{hc}_scale": (3,)})
        if kind != "sliding_attention":
            shapes.update(_compressor_shapes(f"{a}.compressor", h, hd, c.compress_rates[kind],
                                             kind == "compressed_sparse_attention"))
        if kind == "compressed_sparse_attention":
            x = f"{a}.indexer"
            shapes.update(_compressor_shapes(f"{x}.compressor", h, c.index_head_dim,
                                             c.compress_rates[kind], True))
            shapes.update({f"{x}.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                           f"{x}.weights_proj.weight": (c.index_n_heads, h)})
        s = f"{p}.ffn"
        shapes[f"{s}.gate.weight"] = (e, h)
        if c.mlp_layer_types[layer] == "moe":
            shapes[f"{s}.gate.bias"] = (e,)
        else:
            shapes[f"{s}.gate.tid2eid"] = IntegerShape((c.vocab_size, c.num_experts_per_tok))
        for x in [f"{s}.experts.{i}" for i in range(e)] + [f"{s}.shared_experts"]:
            shapes.update({f"{x}.w1.weight": (f, h), f"{x}.w3.weight": (f, h), f"{x}.w2.weight": (h, f)})
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, n = c.hidden_size, c.hc_mult
        shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
                  "model.hc_head.hc_fn": (n, n * h), "model.hc_head.hc_base": (n,), "model.hc_head.hc_scale": (1,)}
        if not self.tied:
            shapes["head.weight"] = (c.vocab_size, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes


def _replicated(megatron: str, hf: str) -> Mapping:
    """A replicated attention tensor, fp32 where transformers keeps it so (norms, sinks, position biases)."""
    fp32 = hf.endswith(("norm.weight", "attn_sink", "ape"))
    return FP32Replicated(megatron, hf) if fp32 else Replicated(megatron, hf)


def _compressor_shapes(prefix: str, h: int, d: int, rate: int, overlap: bool) -> dict[str, tuple[int, ...]]:
    w = 2 * d if overlap else d
    return {f"{prefix}.wkv.weight": (w, h), f"{prefix}.wgate.weight": (w, h), f"{prefix}.ape": (rate, w),
            f"{prefix}.norm.weight": (d,)}
