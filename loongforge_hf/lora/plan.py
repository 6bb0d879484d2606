"""Which HF modules a ``peft.LoraConfig`` names, and where each lives in the megatron model.

Choices:
- Names are matched exactly as PEFT matches them, on the HF module tree itself: the model class is built on the meta
  device from the HF config (no memory, no RNG), and ``peft.tuners.tuners_utils.check_target_module_exists`` decides
  each module (suffix lists, regex strings, ``exclude_modules``, ``layers_to_transform``/``layers_pattern``).
  ``"all-linear"`` means every ``nn.Linear`` (and transformers' ``Conv1D``) but the output embedding, as in PEFT.
  ``modules_to_save`` match by name suffix, as PEFT's ``ModulesToSaveWrapper`` does (``"norm"`` also matches
  ``input_layernorm``); GPT-2's position table (a first-stage tensor, ``first_stage_mappings``) is one of them.
- The order of ``LoraPlan.targets`` is PEFT's creation order (the order it draws the random initialisation in):
  module targets in HF ``named_modules`` order, then parameter targets (``param_targets.py``).
- Each target is tied to the bridge mapping holding its HF weight (``_LINEAR_KINDS``: q/k/v slots of ``linear_qkv``,
  gate/up halves of ``linear_fc1``, ...); a text model's input embedding is a target of kind ``"embedding"``
  (``embedding.py``: PEFT's ``lora.Embedding``), an untied LM head one of kind ``"head"`` (``head.py``; a tied one
  is refused by name); others are refused, listing what can be (a
  last component only where no linear it names is refused, nor ``'all-linear'`` without ``exclude_modules`` for
  those). Linears an architecture refuses by name say why (``_REFUSED``: LongCat-Flash's router ``classifier``,
  whose weight transformers reads itself, so PEFT's adapter there never acts; Zamba / Zamba2's shared blocks'
  linears, one megatron linear for the uses PEFT adapts one by one; the DSA indexers' linears, which no gradient
  reaches; A.X-K2's ``q_b_proj``, the checkpoint's name of ``q_gate_proj``, and its norms' gates; Mamba-1's
  ``dt_proj`` and Gemma 3n's ``correction_coefs``, whose weights transformers reads itself (the latter in training),
  so PEFT's adapter there never acts).
- A linear whose weight a bridge's own module holds as a bare parameter it declares (the bridge's
  ``lora_own_weights``: Mamba-1's ``x_proj``, Doge's ``dt_proj`` / ``router_gate``, Kimi Linear's gate projections)
  is a target of that weight's split (``own_weights.KIND``) with ``Target.own_weight`` set (``own_weights.py``);
  other bare parameters are no targets.
  DiffLlama's ``q_proj`` / ``k_proj`` / ``v_proj`` (``HalvesQKV``: each TP rank a slice of both halves of the heads)
  are ``linear_qkv`` slots whose B rows the mapping puts in megatron's order (``rows_to_megatron``). LongCat-Flash's
  sublayer mappings (``paired_sublayers``) are looked up by the class they stand for (``plain_class``).
- HF linears sharing one megatron linear in slots of unequal rows are each a target with its own adapter, B's rows
  moved to megatron's order by the mapping (``rows_to_megatron(part=Target.slot)``) and sliced per TP rank by its
  ``rank_rows`` (``model._layout_and_slices``): the Gated DeltaNet ``in_proj`` of Qwen3.5 / Qwen3.5-MoE
  (``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``: ``HeadSections``; LaraMini's too, one fused
  ``in_proj`` on disk: its bridge's ``lora_mappings_for_layer`` gives the planner Qwen3.5's split mapping of the same
  megatron rows, so PEFT's names are the adapter's and the merged export writes the fused tensor), of OLMo Hybrid
  (``q`` / ``k`` / ``v`` / ``g`` / ``b`` / ``a_proj``) and of Qwen3-Next (``in_proj_qkvz`` / ``in_proj_ba`` per key
  head: ``KeyHeadGroups``); Qwen3.5's gated ``q_proj`` (``GatedQKV``: per KV group the heads' queries, then their gates)
  beside ``k_proj`` / ``v_proj``; AFMoE's ``q_proj`` / ``k_proj`` / ``v_proj`` beside its gates' own ``gate_proj``
  (``GatedQKV`` with ``gate``: a slot of its own after each group's queries; PEFT's rewrite on transformers 5 leaves
  ``gate_proj`` to the experts, so it is never a target). So ``"all-linear"`` takes them all. DoRA and PiSSA /
  OLoRA on them are refused by name (``_check_unequal_slots``: not tested against PEFT there). Gemma 4's
  ``q_proj`` / ``k_proj`` / ``v_proj`` (``PerTypeQKV``) are plain ``QKV`` slots with each layer type's head size
  and KV heads; its full layers with values from keys have no ``v_proj`` (in transformers' tree, so in PEFT's
  targets, as here); MiMo-V2-Flash's ``v_proj`` slot has its value heads' own width.
- One HF linear of row sections that megatron holds rank by rank (``gated_mappings.HeadSections`` of one part: the
  Mamba2 ``in_proj`` of Granite 4.0 H, Bamba and Nemotron-H, its z, x, B, C, dt; LFM2's conv ``in_proj``, its B, C,
  x) is a column-parallel target: B's rows go to megatron's order as the weight's do (``rows_to_megatron``). Where a
  section is replicated over TP (Mamba2's B / C with fewer groups than TP ranks) it is refused
  (``model.check_replicated_rows``).
- A bridge whose checkpoint names differ from transformers' module tree (EXAONE 3: ``transformer.h.N.attn.attention
  .out_proj`` for ``model.layers.N.self_attn.o_proj``) gives ``checkpoint_name``, the planner's way from PEFT's name
  to the bridge's tensor (as image-text bridges give their trees' prefixes); PEFT's names stay the adapter's, the
  checkpoint's last component names the adapter's slot in the megatron module (``Target.slot_name``).
- A sequence classifier (``lf.AutoModelForSequenceClassification``) is matched on transformers' classifier tree,
  ``task_type="SEQ_CLS"`` adding its ``score`` head to ``modules_to_save`` (``lora/sequence_classification.py``).
- ``modules_to_save`` may name norms, ``embed_tokens`` and an untied ``lm_head`` (whole parameters megatron keeps
  replicated or vocab-split); a tensor-parallel linear there is refused (its rows are fused with others' in megatron).
- Mixture-of-experts models (Qwen3-MoE, Mixtral): PEFT on transformers 5 first rewrites the config of these models
  (``peft.utils.transformers_weight_conversion``): a name of an expert projection or the router (``gate_proj``,
  ``up_proj``, ``down_proj``, ``w1``/``w2``/``w3``, ``gate``; ``"all-linear"`` names them all) becomes a
  ``target_parameters`` entry on the 3-D expert stacks (``gate_up_proj`` with r and alpha doubled by
  ``rank_pattern``/``alpha_pattern``, ``down_proj``) or the router (``gate.weight``), and a string ``target_modules``
  (a regex) becomes the set of leaf names it matches (so a regex naming one layer's ``q_proj`` adapts ``q_proj`` in
  every layer). The same rewrite runs here, with PEFT's own function, on the skeleton; what it leaves in
  ``target_modules`` is matched as above, its ``target_parameters`` by ``param_targets.py`` (adapted by
  ``experts.py``). A fused half named alone (``gate_proj`` without ``up_proj``) is refused as PEFT refuses it.
- ``use_dora``: ``dora.py``; ``rank_pattern`` / ``alpha_pattern``: ``param_targets.rank_and_alpha``. Refused with a
  clear message: ``lora_bias``, ``target_parameters`` other than the MoE models' expert stacks and router,
  ``lora_dropout`` with parameter targets, ``layer_replication``, other initialisations (LoftQ, EVA, CorDA, MiCA,
  LoRA-GA, ...). ``init_lora_weights``: True, False, "gaussian", "orthogonal", and the ones that decompose the base
  weight, "pissa", "pissa_niter_<n>", "olora" (``init.py``; not on expert stacks, the router or a vision tower).
  ``trainable_token_indices``: ``tokens.py``. Qwen2-MoE's ``shared_expert_gate`` (a raw parameter): ``experts.py``.
- DeepSeek-V2/V3 (multi-latent attention): each HF projection is one megatron linear (``q_proj`` or ``q_a_proj`` /
  ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``: column-parallel, the down projections too; ``o_proj``:
  row-parallel), adapted as any plain linear. Where the checkpoint keeps rotary rows in halves and megatron in pairs
  (``RopeColumnParallel``), B's rows are permuted like the weight's on the way in and back on the way out
  (``Target.b_to_megatron`` / ``b_to_hf``). PEFT's rewrite takes the expert names (``gate_proj``, ``up_proj``,
  ``down_proj``) from the modules there too, so the shared experts and the dense first layers' MLPs carry none.
- A bridge whose own modules keep plain torch linears whole on every rank says so (``lora_replicated_linears``):
  a linear whose weight a ``Replicated`` mapping holds is then a target of kind ``"replicated"`` (``replicated.py``;
  DeepSeek-V4's attention, compressors and indexer). DeepSeek-V4's grouped ``o_a_proj`` (PEFT's layer fails on it)
  and HY-V4's indexer linears (no gradient reaches them) are refused by name (``_REFUSED``).
- A router that is a plain ``nn.Linear`` (HunYuan-MoE's ``gate.wg``, DBRX's ``router.layer``, Gemma 4's
  ``router.proj``: megatron's router weight holds it) is a module target of kind ``"router"``, adapted as a router
  named in ``target_parameters`` (``experts.py``: ``W + scaling * B A`` in the gating, after the router's own
  ``gating_input`` where it has one, the same as PEFT's module term without dropout); ``lora_dropout`` is refused on
  it.
- Phi-3's packed ``qkv_proj`` / ``gate_up_proj``: one adapter each, as in PEFT; B's rows go to megatron's fused order
  as the weight's do (``packed_mappings``), each TP rank holding those of its own heads / MLP rows.
- transformers' ``Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``: a linear whose weight is stored ``[in, out]``,
  ``conv1d_mappings.Transposed``) is a linear here as in PEFT (``"all-linear"`` included): A ``[r, in]``, B
  ``[out, r]``, DoRA's magnitude over the output features, the delta ``(B @ A)^T`` in the stored layout, which is
  what megatron's ``[out, in]`` weight gets as ``B @ A``; the adapter kind is the wrapped mapping's. As PEFT, the
  config's ``fan_in_fan_out`` is set to whether the targets are ``Conv1D`` ones (with PEFT's warning where that
  changes it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from loongforge_hf.bridges.conv1d_mappings import Transposed
from loongforge_hf.bridges.diffllama import HalvesQKV
from loongforge_hf.bridges.fused_mappings import QKV, GatedMLP, RopeColumnParallel
from loongforge_hf.bridges.gated_mappings import GatedQKV, HeadSections, KeyHeadGroups
from loongforge_hf.bridges.gemma4_attention import PerTypeQKV
from loongforge_hf.bridges.packed_mappings import GroupedQKV, PackedGatedMLP, PackedQKV, ShardInterleavedQKV
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel, VocabParallel
from loongforge_hf.bridges.moe import SharedExpertGate
from loongforge_hf.bridges.per_head_mappings import PerHeadStack
from loongforge_hf.lora.own_weights import KIND

_LINEAR_KINDS = {QKV: "qkv", GatedMLP: "gated", ColumnParallel: "column", RopeColumnParallel: "column",
                 PackedQKV: "column", GroupedQKV: "column", PackedGatedMLP: "column", RowParallel: "row",
                 SharedExpertGate: "shared_gate", HeadSections: "column", KeyHeadGroups: "column", GatedQKV: "qkv",
                 PerTypeQKV: "qkv", HalvesQKV: "qkv", ShardInterleavedQKV: "column"}
_INITS = (True, False, "gaussian", "orthogonal")
_DSA_INDEXER = dict.fromkeys(
    ("wq_b", "wk", "weights_proj"), "DeepSeek Sparse Attention's lightning indexer only picks the top-k keys: no "
                                    "gradient reaches its linears (in transformers neither), so an adapter there "
                                    "never trains")
# NOTE: linears refused by name, with why (architecture -> {transformers' last component: why}): those a bridge
# re-classes after the build (no plain megatron linear LoRA's layers take) or holds in rows LoRA's slicing misses
_REFUSED = {
    **dict.fromkeys(("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"), _DSA_INDEXER),
    "AXK2ForCausalLM": {
        **_DSA_INDEXER,
        "q_b_proj": "the checkpoint's name of A.X-K2's gated query up-projection; transformers' module, which PEFT "
                    "targets, is q_gate_proj",
        **dict.fromkeys(("fc1", "fc2"), "the gated norms' low-rank gate (W_down / W_up on disk) is two weights of "
                                        "megatron's norm here, not linears; modules_to_save=['input_layernorm', "
                                        "'post_attention_layernorm'] trains them whole")},
    **dict.fromkeys(("ZambaForCausalLM", "Zamba2ForCausalLM"), {
        **dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj"),
                        "a shared transformer block's linear: transformers keeps a tied copy of the block in each "
                        "hybrid layer, so PEFT gives each use its own adapter, where megatron runs one linear for "
                        "all the uses"),
        "linear": "the hybrid layer's linear is a plain replicated torch linear here, not a megatron linear",
        **dict.fromkeys(("0", "1"), "the per-use adapters' linears (the shared blocks' adapter lists) are no "
                                    "megatron linears here")}),
    **dict.fromkeys(("MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM"), {
        "dt_proj": "transformers' Mamba mixers read dt_proj.weight themselves (dt_proj.weight @ time_step), so PEFT's "
                   "adapter on the module never reaches the time steps"}),
    "Gemma3nForCausalLM": {
        "correction_coefs": "transformers' AltUp applies correction_coefs.weight itself in training (clamped to "
                            "altup_coef_clip), so PEFT's adapter there acts in eval only"},
    "LongcatFlashForCausalLM": {
        "classifier": "transformers' LongCat-Flash router reads classifier.weight itself (F.linear on its fp32 copy), "
                      "so PEFT's adapter on the module never reaches the routing"},
    "DeepseekV4ForCausalLM": {
        "o_a_proj": "DeepSeek-V4's grouped output projection (DeepseekV4GroupedLinear) maps each head group on its "
                    "own; PEFT's LoRA layer on it adds a [groups, groups * o_lora_rank] term to its [groups, "
                    "o_lora_rank] output and fails in the forward"},
    "HYV4ForCausalLM": dict.fromkeys(
        ("wq_b", "wk", "weights_proj"), "HY-V4's lightning indexer only picks the top-k keys: no gradient reaches "
                                        "its linears (in transformers neither), so an adapter there never trains"),
}


class LoraConfigError(ValueError):
    """A LoraConfig (or model) this LoRA implementation cannot apply."""


@dataclass(frozen=True)
class Target:
    """One HF linear that gets an adapter, e.g. ``model.layers.3.self_attn.k_proj``."""

    hf_module: str
    layer: int                  # global decoder layer index
    mapping: Mapping            # the bridge mapping holding its weight
    slot: int                   # position of its weight in ``mapping.hf_names(layer)``
    kind: str                   # "qkv" | "gated" | "column" | "row" | "shared_gate" | "experts" | "router" |
    #                             "replicated" (replicated.py) | "embedding" (embedding.py: in = vocab, out = hidden)
    #                             | "head" (head.py: the untied LM head, B split over TP by the vocabulary)
    in_features: int
    out_features: int
    r: int
    scaling: float
    num_experts: int = 1        # PEFT's ParamWrapper on a 3-D expert stack: A [r * E, in], B [out, r * E]
    factors_swapped: bool = False   # PEFT's A on the stack's output side, B on its input (experts.py: Llama 4's
    #                                 [E, in, out] stacks, which PEFT reads as [E, out, in])
    slot_name: str | None = None    # adapter key in the megatron module when not the HF module's last component
    module_path: str | None = None  # megatron module (with ``{layer}``) when not the mapping's weight's module
    own_weight: str | None = None   # the bridge module's own weight parameter the adapter is on (own_weights.py)

    @property
    def name(self) -> str:
        """The slot name inside the megatron module: the HF module's last component (``k_proj``)."""
        return self.slot_name or self.hf_module.rsplit(".", 1)[-1]

    @property
    def megatron_module(self) -> str:
        """Megatron module path with ``{layer}`` for the local layer index."""
        return self.module_path or getattr(self.mapping, "module_path", self.mapping.megatron.removesuffix(".weight"))

    @property
    def stored_transposed(self) -> bool:
        """Whether the checkpoint stores the weight ``[in, out]`` (transformers' ``Conv1D``: PEFT's
        ``fan_in_fan_out``); A and B have the usual shapes all the same."""
        return isinstance(self.mapping, Transposed)

    @property
    def file_factors(self) -> tuple[str, str]:
        """A's and B's names after the HF module in PEFT's adapter file (its embedding layer's are parameters)."""
        return ("lora_embedding_A", "lora_embedding_B") if self.kind == "embedding" else \
            ("lora_A.weight", "lora_B.weight")

    @property
    def a_shape(self) -> tuple[int, int]:
        return (self.r * self.num_experts, self.in_features)

    @property
    def b_shape(self) -> tuple[int, int]:
        return (self.out_features, self.r * self.num_experts)

    def b_to_megatron(self, b: torch.Tensor, ctx) -> torch.Tensor:
        """B [out, r] at HF shape with its rows in the order megatron holds the weight's rows, TP rank after TP rank
        (``ctx``: the ``ShardContext``): rotary rows in pairs where the checkpoint keeps them in halves
        (``RopeColumnParallel``), q / k / v or gate / up rows of a packed HF linear in megatron's fused layout
        (``PackedQKV``, ``PackedGatedMLP``)."""
        permute = getattr(self.mapping, "rows_to_megatron", None)
        # NOTE: a mapping of several HF tensors with rows to move (HeadSections, KeyHeadGroups, GatedQKV) takes the
        # target's own (``part``, 0 by default)
        return b if permute is None else permute(b, ctx, part=self.slot) if self.slot else permute(b, ctx)

    def b_to_hf(self, b: torch.Tensor, ctx) -> torch.Tensor:
        """The inverse of ``b_to_megatron`` (the gathered B of this target, back in the checkpoint's row order)."""
        permute = getattr(self.mapping, "rows_to_hf", None)
        return b if permute is None else permute(b, ctx, part=self.slot) if self.slot else permute(b, ctx)


@dataclass(frozen=True)
class SavedTensor:
    """A whole HF parameter trained and saved because its module is in ``modules_to_save``."""

    hf_name: str                # the parameter in the HF module tree (PEFT's key)
    mapping: Mapping
    layer: int | None
    file_name: str | None = None  # its name in the checkpoint, where it differs (image-text models)

    @property
    def checkpoint_name(self) -> str:
        return self.file_name or self.hf_name


@dataclass
class LoraPlan:
    targets: list[Target]
    saved: list[SavedTensor]
    target_modules: list[str] | str         # as written to adapter_config.json
    config: object                          # the LoraConfig as PEFT holds it (rewritten for MoE models, see above)
    hf_param_count: int                     # parameters of the HF model without adapters
    hf_shapes: dict[str, tuple[int, ...]] = field(repr=False, default_factory=dict)
    token_indices: tuple[int, ...] = ()     # trainable_token_indices of the input embedding (tokens.py)
    embedding_name: str = "model.embed_tokens"


def _hf_skeleton(hf_config, image_text: bool = False, classifier: bool = False):
    """The HF model class built on the meta device: names, module types and shapes, no memory. Under a forked RNG:
    some classes draw while they are built even on the meta device (DiffLlama's lambdas, by ``torch.normal`` on the
    CPU generator), which would move the adapters' seeded initial factors off PEFT's."""
    import transformers

    auto = transformers.AutoModelForImageTextToText if image_text else \
        transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    unmapped = unmapped_class(hf_config, auto)
    build = auto.from_config if unmapped is None else unmapped._from_config
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return build(hf_config)


def unmapped_class(hf_config, auto) -> type | None:
    """None where transformers' ``auto`` class maps ``hf_config``; else (Mistral 4, Emu3's text model) the
    transformers class its ``architectures`` names, which PEFT's model is built on."""
    import transformers

    if type(hf_config) in auto._model_mapping:
        return None
    name = (getattr(hf_config, "architectures", None) or [""])[0]
    if not hasattr(transformers, name):
        raise LoraConfigError(f"transformers' {auto.__name__} does not map {type(hf_config).__name__} and its "
                              f"architectures {hf_config.architectures!r} name no transformers class: LoRA "
                              "matches PEFT's names on transformers' model, which cannot be built.")
    return getattr(transformers, name)


def _check_config(config) -> None:
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise LoraConfigError(f"loongforge-hf applies LoRA (peft.LoraConfig); got {type(config).__name__}.")
    refused = {"lora_bias": config.lora_bias, "layer_replication": config.layer_replication}
    set_fields = {k: v for k, v in refused.items() if v}
    if set_fields:
        raise LoraConfigError(f"LoraConfig fields {sorted(set_fields)} are not supported on megatron layers; "
                              "supported: r, lora_alpha, rank_pattern, alpha_pattern, lora_dropout, use_rslora, "
                              "target_modules, exclude_modules, layers_to_transform, layers_pattern, modules_to_save, "
                              "use_dora, fan_in_fan_out (set as PEFT sets it), init_lora_weights (True, False, "
                              "'gaussian', 'orthogonal', 'pissa', 'pissa_niter_<n>', 'olora').")
    if config.bias != "none":
        raise LoraConfigError(f"LoraConfig(bias={config.bias!r}) is not supported; use bias='none'.")
    from loongforge_hf.lora.init import is_decomposition

    if config.init_lora_weights not in _INITS and not is_decomposition(config.init_lora_weights):
        raise LoraConfigError(f"LoraConfig(init_lora_weights={config.init_lora_weights!r}) is not supported; use "
                              "True (PEFT's default), False, 'gaussian', 'orthogonal', 'pissa', 'pissa_niter_<n>' "
                              "(n: a number of subspace iterations, e.g. 'pissa_niter_4') or 'olora'.")
    if not isinstance(config.r, int) or config.r < 1:
        raise LoraConfigError(f"LoraConfig(r={config.r!r}): r must be a positive integer.")
    if config.target_modules is None and not config.target_parameters:
        raise LoraConfigError("LoraConfig(target_modules=None): name the HF modules to adapt, e.g. "
                              "target_modules=['q_proj', 'v_proj'] or 'all-linear'.")


def _hf_tensor_index(bridge) -> dict[str, tuple[Mapping, int | None, int]]:
    """HF tensor name -> (bridge mapping, global layer or None, position among the mapping's HF names)."""
    from loongforge_hf.bridges.fused_mappings import Expert
    from loongforge_hf.bridges.loader import first_stage_mappings

    index: dict[str, tuple[Mapping, int | None, int]] = {}
    # NOTE: a bridge whose checkpoint fuses linears transformers' tree splits gives the split mappings (LaraMini)
    layer_mappings = getattr(bridge, "lora_mappings_for_layer", bridge.mappings_for_layer)
    for layer in range(bridge.hf_config.num_hidden_layers):
        for m in layer_mappings(layer):
            if isinstance(m, Expert):  # routed experts: 3-D parameters in transformers, never a LoRA module target
                continue
            for i, n in enumerate(m.hf_names(layer)):
                index[n] = (m, layer, i)
    for m in [bridge.embedding_mapping(), *first_stage_mappings(bridge), *bridge.final_mappings()]:
        for i, n in enumerate(m.hf_names(None)):
            index[n] = (m, None, i)
    return index


def plan_lora(bridge, config, vl_bridge=None) -> LoraPlan:
    """Resolve ``config`` against the HF module tree of ``bridge``'s model (same verdict on every rank); for an
    image-text model, ``bridge`` is its language model's and ``vl_bridge`` the whole model's (``vision.py``)."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    from loongforge_hf.lora.dora import check_dora
    from loongforge_hf.lora.embedding import check_embedding_options
    from loongforge_hf.lora.head import TIED_HEAD, check_head_options
    from loongforge_hf.lora.init import check_decomposition
    from loongforge_hf.lora.replicated import check_replicated_options
    from loongforge_hf.lora.param_targets import (as_peft_rewrites, plan_param_targets, rank_and_alpha,
                                                  refuse_own_forward_linears)
    from loongforge_hf.lora.tokens import token_indices_of
    from loongforge_hf.lora.vision import checkpoint_names, vision_index

    from loongforge_hf.lora.sequence_classification import classifier_config, classifier_head, is_classifier

    _check_config(config)
    classifier = is_classifier(bridge)
    if classifier:  # NOTE: PEFT's SEQ_CLS: the score head in modules_to_save (lora/sequence_classification.py)
        config = classifier_config(config)
    skeleton = _hf_skeleton((vl_bridge or bridge).hf_config, image_text=vl_bridge is not None, classifier=classifier)
    config = as_peft_rewrites(config, skeleton, bridge)
    # NOTE: a text bridge whose checkpoint names differ from transformers' module tree says how (EXAONE 3)
    on_disk = checkpoint_names(vl_bridge) if vl_bridge is not None else \
        getattr(bridge, "checkpoint_name", checkpoint_names(None))
    param_targets = plan_param_targets(config, skeleton, bridge, on_disk)
    output_embedding = classifier_head(skeleton) if classifier else skeleton.get_output_embeddings()
    modules = list(skeleton.named_modules())
    linear_names = {n for n, mod in modules if isinstance(mod, (nn.Linear, Conv1D)) and mod is not output_embedding}
    all_linear = isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear"
    matcher = config
    if all_linear:
        from copy import copy

        matcher = copy(config)
        matcher.target_modules = linear_names

    index = {**_hf_tensor_index(bridge), **vision_index(vl_bridge)}
    why = _refused_by_name(bridge)
    # NOTE: the input embedding (PEFT's lora.Embedding: embedding.py), a text model's
    embedding = None if vl_bridge is not None else skeleton.get_input_embeddings()
    # NOTE: the untied LM head of a text model (head.py); a tied one is refused by name
    head = None if vl_bridge is not None or classifier else output_embedding
    if head is not None and bridge.tied:
        why = {**why, name_of(modules, head): TIED_HEAD}
    # NOTE: plain torch linears of a bridge's own modules, whole on every rank (replicated.py), where it opts in;
    # weights its own modules hold as parameters, with their TP split (own_weights.py)
    replicated = bool(getattr(bridge, "lora_replicated_linears", False))
    own = dict(getattr(bridge, "lora_own_weights", {}))
    asked = set(config.target_modules) if isinstance(config.target_modules, (list, set)) else set()
    targets: list[Target] = []
    refused: list[str] = []
    conv1d = None  # NOTE: whether the last module target is a Conv1D: PEFT's fan_in_fan_out ends so
    for name, module in modules:
        # NOTE: an excluded module comes back as a falsy marker object.
        if not name or not check_target_module_exists(matcher, name):
            continue
        entry = None if name.rsplit(".", 1)[-1] in why else \
            _adaptable(name, module, index, on_disk, replicated, own, embedding, head)
        if entry is None:
            refused.append(name)
            continue
        mapping, layer, slot, kind = entry
        r, alpha = rank_and_alpha(config, name)
        scaling = alpha / (math.sqrt(r) if config.use_rslora else r)
        if kind == "embedding":  # NOTE: PEFT's fan_in_fan_out is not the embedding's
            in_features, out_features = module.num_embeddings, module.embedding_dim
        else:
            conv1d = isinstance(module, Conv1D)
            in_features, out_features = (module.nx, module.nf) if conv1d else (module.in_features, module.out_features)
        # NOTE: the adapter's key in the megatron module is the checkpoint's name of the linear (EXAONE 3's
        # out_proj for transformers' o_proj), as the fused layouts name their slots (model._layout_and_slices)
        leaf = on_disk(f"{name}.weight").removesuffix(".weight").rsplit(".", 1)[-1]
        module_path, own_weight = _own_weight(mapping, own)
        targets.append(Target(hf_module=name, layer=layer, mapping=mapping, slot=slot, kind=kind,
                              in_features=in_features, out_features=out_features, r=r, scaling=scaling,
                              slot_name="router" if kind == "router" else None if leaf == name.rsplit(".", 1)[-1]
                              else leaf, module_path=module_path, own_weight=own_weight))
    if refused:
        refuse_own_forward_linears(refused, dict(modules))
        reasons = _reasons({n.rsplit(".", 1)[-1] for n in refused} | asked, why)
        raise LoraConfigError(f"target_modules match {refused[:4]}{' ...' if len(refused) > 4 else ''}, which "
                              f"cannot carry a LoRA adapter on megatron layers{reasons}; targetable modules: "
                              f"{_targetable(modules, linear_names, index, on_disk, why, replicated, own)}.")
    _set_fan_in_fan_out(config, conv1d, bool(param_targets))
    routers = sorted({t.hf_module.rsplit(".", 1)[-1] for t in targets if t.kind == "router"})
    if routers and float(config.lora_dropout):
        raise LoraConfigError(f"lora_dropout={config.lora_dropout} with LoRA on the router's linear ({routers}): its "
                              "adapter is added to the router's weight here, which leaves no input to drop out; set "
                              f"lora_dropout=0, or leave it out: exclude_modules={routers} (with 'all-linear').")
    targets += param_targets
    check_embedding_options(config, targets, config.trainable_token_indices)
    check_head_options(config, targets)
    check_dora(config, targets)
    check_decomposition(config.init_lora_weights, targets)
    check_replicated_options(config, targets)
    _check_unequal_slots(config, targets)
    if not targets:
        raise LoraConfigError(f"target_modules={config.target_modules!r} match no module of "
                              f"{type(skeleton).__name__}{_reasons(asked, why)}; targetable: "
                              f"{_targetable(modules, linear_names, index, on_disk, why, replicated, own)}.")

    saved = _saved_tensors(config, modules, index, bridge, output_embedding, on_disk)
    embedding = skeleton.get_input_embeddings()
    embedding_name = next(n for n, mod in modules if mod is embedding)
    token_indices = token_indices_of(config, bridge, embedding_name)
    shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
    target_modules = _saved_all_linear(linear_names, [n for n, _ in modules]) if all_linear else (
        config.target_modules if isinstance(config.target_modules, str) else sorted(config.target_modules or []))
    return LoraPlan(targets=targets, saved=saved, target_modules=target_modules, config=config,
                    hf_param_count=sum(math.prod(s) for s in shapes.values()), hf_shapes=shapes,
                    token_indices=token_indices, embedding_name=embedding_name)


def _adaptable(name: str, module, index, on_disk, replicated: bool = False, own: dict | None = None,
               embedding=None, head=None) -> tuple[Mapping, int | None, int, str] | None:
    """(mapping, layer, slot, kind) of the HF module ``name`` where it can carry an adapter here, else None: a linear
    whose weight a linear kind of mapping holds (``_LINEAR_KINDS``) in a decoder layer, or a tower linear; with
    ``replicated`` (the bridge's ``lora_replicated_linears``) also one a ``Replicated`` mapping holds there; one whose
    weight a bridge module holds as its own parameter where ``own`` (the bridge's ``lora_own_weights``: parameter
    name -> TP split, own_weights.py) names it, of that split's kind; the model's input ``embedding`` (module) where
    megatron's vocab-parallel embedding holds it (kind ``"embedding"``, no layer); the untied LM ``head`` (module)
    where megatron's output layer holds it (kind ``"head"``, no layer: head.py)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    if module is not None and module is embedding:
        entry = index.get(on_disk(f"{name}.weight"))
        return (*entry, "embedding") if entry is not None and type(entry[0]) is VocabParallel and \
            entry[0].megatron == "embedding.word_embeddings.weight" else None
    if module is not None and module is head:
        entry = index.get(on_disk(f"{name}.weight"))
        return (*entry, "head") if entry is not None and type(entry[0]) is VocabParallel and \
            entry[0].megatron == "output_layer.weight" else None
    entry = index.get(on_disk(f"{name}.weight")) if isinstance(module, (nn.Linear, Conv1D)) else None
    if entry is None:
        return None
    plain = type(_unwrapped(entry[0]))
    # NOTE: a mapping re-classed for LongCat-Flash's sublayer names stands for its plain class (paired_sublayers)
    kind = "vision" if _in_tower(entry[0]) else _LINEAR_KINDS.get(getattr(plain, "plain_class", plain))
    if kind is None and type(module).forward is nn.Linear.forward and \
            _unwrapped(entry[0]).megatron.endswith(".mlp.router.weight"):
        kind = "router"  # NOTE: a plain linear router (HunYuan's gate.wg, DBRX's router.layer): experts.py's adapter
    if replicated and kind is None and plain is Replicated:  # NOTE: replicated.py
        kind = "replicated"
    bare = _unwrapped(entry[0]).megatron.rsplit(".", 1)[-1]
    if not _unwrapped(entry[0]).megatron.endswith(".weight") and kind in ("column", "row", "replicated", None):
        kind = KIND.get((own or {}).get(bare))  # NOTE: a bare parameter, not a linear's weight: where declared
    return None if kind is None or (entry[1] is None and kind != "vision") else (*entry, kind)


def _own_weight(mapping: Mapping, own: dict) -> tuple[str | None, str | None]:
    """(module, parameter) of a weight a bridge module holds as a bare parameter it declares (``own``: Mamba-1's
    ``x_proj_weight``), not a linear's ``.weight``; (None, None) for others."""
    megatron = _unwrapped(mapping).megatron
    module, weight = megatron.rsplit(".", 1)
    return (None, None) if megatron.endswith(".weight") or weight not in own else (module, weight)


def _check_unequal_slots(config, targets) -> None:
    """Refuse DoRA and PiSSA / OLoRA on the HF linears that share one megatron linear in slots of their own shape
    (the Gated DeltaNet in-projections, Qwen3.5's gated ``q_proj`` beside ``k_proj`` / ``v_proj``): not tested
    against PEFT there."""
    from loongforge_hf.lora.init import is_decomposition

    asked = [f"use_dora={config.use_dora}"] if config.use_dora else []
    if is_decomposition(config.init_lora_weights):
        asked.append(f"init_lora_weights={config.init_lora_weights!r}")
    hit = sorted({t.hf_module.rsplit(".", 1)[-1] for t in targets if isinstance(t.mapping, (GatedQKV, KeyHeadGroups))
                  or (isinstance(t.mapping, HeadSections) and len(t.mapping.parts) > 1)})
    if asked and hit:
        raise LoraConfigError(f"{' and '.join(asked)} is not supported on {hit} (HF linears sharing one megatron "
                              "linear in slots of unequal rows: the linear-attention in-projections, the gated "
                              f"q_proj / k_proj / v_proj); leave them out (exclude_modules={hit}) or use plain LoRA.")


def name_of(modules, module) -> str:
    """The last component of ``module``'s name among ``modules`` (named_modules' pairs)."""
    return next(n for n, m in modules if m is module).rsplit(".", 1)[-1]


def _refused_by_name(bridge) -> dict[str, str]:
    """{last component: why} of the linears ``bridge``'s architecture refuses by name (``_REFUSED``)."""
    return {k: v for arch in getattr(bridge, "architectures", ()) for k, v in _REFUSED.get(arch, {}).items()}


def _reasons(leaves, why: dict[str, str]) -> str:
    """`` (q_proj, v_proj: why)`` for the ``leaves`` refused by name, those of one reason together; "" for none."""
    named = sorted(set(leaves) & set(why))
    text = "; ".join(f"{', '.join(k for k in named if why[k] == w)}: {w}" for w in dict.fromkeys(why[k] for k in named))
    return f" ({text})" if text else ""


def _targetable(modules, linear_names: set[str], index, on_disk, why: dict[str, str], replicated: bool = False,
                own: dict | None = None) -> str:
    """What a refusal lists: the last components of the linears that can carry an adapter, leaving out one that also
    names a linear that cannot (Qwen3.5's ``in_proj_z``: one slot of four in megatron's ``in_proj``) or is refused by
    name (``why``), and ``'all-linear'``, with ``exclude_modules`` naming those that cannot where there are any."""
    leaf = {n: n.rsplit(".", 1)[-1] for n in linear_names}
    refused = {n for n, m in modules if n in linear_names
               and (leaf[n] in why or _adaptable(n, m, index, on_disk, replicated, own) is None)}
    names = sorted({leaf[n] for n in linear_names - refused} - {leaf[n] for n in refused})
    excluded = f" with exclude_modules={sorted({leaf[n] for n in refused})}" if refused else ""
    return f"{names} or 'all-linear'{excluded}"


def _unwrapped(mapping: Mapping) -> Mapping:
    """The mapping a weight stored transposed (``Conv1D``) would have as an ``nn.Linear`` weight; others as they are."""
    return mapping.inner if isinstance(mapping, Transposed) else mapping


def _set_fan_in_fan_out(config, conv1d: bool | None, params: bool) -> None:
    """``config.fan_in_fan_out`` as PEFT leaves it (``lora.layer.dispatch_default``: True on a ``Conv1D`` target,
    False on an ``nn.Linear`` one, the last module target deciding; ``conv1d`` None: no module target), with PEFT's
    warning where that changes it; refused where it stays True for parameter targets (``params``), as PEFT's
    ``ParamWrapper`` refuses it."""
    import warnings

    if conv1d is None and config.fan_in_fan_out and params:
        raise LoraConfigError("LoraConfig(fan_in_fan_out=True) does not apply to target_parameters (PEFT's "
                              "ParamWrapper refuses it too): leave fan_in_fan_out False.")
    if conv1d is None or bool(config.fan_in_fan_out) == conv1d:
        return
    warnings.warn("fan_in_fan_out is set to False but the target module is `Conv1D`. Setting fan_in_fan_out to True."
                  if conv1d else "fan_in_fan_out is set to True but the target module is `torch.nn.Linear`. Setting "
                  "fan_in_fan_out to False.")
    config.fan_in_fan_out = conv1d


def _in_tower(mapping: Mapping) -> bool:
    return mapping.megatron.startswith("vision.")  # NOTE: image-text models' tower linears (vision.vision_index)


def _saved_all_linear(names: set[str], module_names: list[str]) -> list[str]:
    """``target_modules`` as PEFT saves "all-linear": the full names, condensed to the shortest unambiguous suffixes
    (``q_proj``, ``attn.proj``, ``mlp.0``) where there are at least PEFT's threshold of them."""
    from peft.tuners.tuners_utils import _find_minimal_target_modules
    from peft.utils.constants import MIN_TARGET_MODULES_FOR_OPTIMIZATION

    if len(names) < MIN_TARGET_MODULES_FOR_OPTIMIZATION:
        return sorted(names)
    suffixes = tuple("." + n for n in names)
    minimal = _find_minimal_target_modules(names, [n for n in module_names if n not in names
                                                   and not n.endswith(suffixes)])
    return sorted(minimal if len(minimal) < len(names) else names)


def _saved_tensors(config, modules, index, bridge, skeleton_output, on_disk) -> list[SavedTensor]:
    wanted = list(config.modules_to_save or [])
    if not wanted:
        return []
    saved: list[SavedTensor] = []
    seen: set[str] = set()
    for name, module in modules:
        if not name or not any(name.endswith(m) for m in wanted):
            continue
        for pname, param in module.named_parameters():
            if (full := f"{name}.{pname}") in seen:
                continue
            seen.add(full)
            entry = index.get(on_disk(full))
            if entry is None and bridge.tied and module is skeleton_output:
                raise LoraConfigError(f"modules_to_save={wanted}: {full} is the embedding's own weight (tie_word_"
                                      "embeddings=True), which is not supported; train the added tokens' rows with "
                                      "trainable_token_indices (PEFT ties the LM head's rows to them).")
            # NOTE: whole tensors, or a norm's own weight split over TP with the heads (OLMo 2's q / k norms over all
            # heads, Cohere's [heads, head_dim], StableLM's one tensor per head stacked), never a linear's
            if entry is None or _in_tower(entry[0]) or not (isinstance(entry[0], (Replicated, VocabParallel)) or (
                    type(entry[0]) in (ColumnParallel, PerHeadStack) and not isinstance(module, torch.nn.Linear))):
                raise LoraConfigError(f"modules_to_save={wanted}: {name} ({full}) cannot be trained whole here (a "
                                      "tensor-parallel linear megatron fuses with others, or the vision tower); it "
                                      "supports the language model's norms, embed_tokens and lm_head.")
            if isinstance(entry[0], VocabParallel) and bridge.tied:
                raise LoraConfigError(f"modules_to_save={wanted}: {full} is tied to the LM head "
                                      "(tie_word_embeddings=True), which is not supported.")
            saved.append(SavedTensor(hf_name=full, mapping=entry[0], layer=entry[1], file_name=on_disk(full)))
    if not saved:
        raise LoraConfigError(f"modules_to_save={wanted} match no module of the model.")
    return saved
