"""Run inside each rank: for several layouts in turn and several checkpoints per layout, load with loongforge-hf,
compare with transformers, run a backward pass (no pipeline), export. One world serves every layout of its size (the
process groups are rebuilt between layouts), so the import and start-up cost of a rank is paid once per world size."""

import os
import re
import warnings

import torch


# NOTE: the DeepSeek Sparse Attention cases whose generate runs with the KV cache (_dsa_generate)
DSA_GENERATE = ("deepseek_v32", "glm_moe_dsa", "axk2")
_STACKS = (r"\.(experts\.(gate_up_proj|down_proj|fc1\.weight|fc2\.weight)(_bias)?"  # NOTE: fc1 / fc2: Aria's
           r"|block_sparse_moe\.(input|output)_linear\.weight)$")


class _RecordingReader:
    """A CheckpointReader that remembers which tensors were read."""

    def __init__(self, reader, expert_rows: int = 0) -> None:
        self.reader, self.read, self.expert_rows = reader, set(), expert_rows

    def __getattr__(self, item):
        return getattr(self.reader, item)

    def _record(self, name, rows: range | None = None) -> None:
        # NOTE: gpt-oss and GraniteMoE stack their experts in one tensor per projection: a read of rows of it reads
        # those experts (a Granite shared_mlp's input / output_linear is no stack); DBRX's 2-D w1 / v1 / w2 hold
        # ``expert_rows`` rows per expert
        if self.expert_rows and re.search(r"\.ffn\.experts\.mlp\.(w1|v1|w2)$", name):
            self.read.update(f"{name}#expert{r // self.expert_rows}"
                             for r in (rows or range(self.reader.shape(name)[0])))
        elif re.search(_STACKS, name):
            self.read.update(f"{name}#expert{e}" for e in (rows or range(self.reader.shape(name)[0])))
        else:
            self.read.add(name)

    def get(self, name):
        self._record(name)
        return self.reader.get(name)

    def get_slice(self, name, **kwargs):
        self._record(name, range(kwargs["start"], kwargs["stop"]) if kwargs.get("dim") == 0 else None)
        return self.reader.get_slice(name, **kwargs)


def _expert_reads(model, folder: str) -> dict:
    """Load the checkpoint into the model once more through a recording reader: which experts does this rank read?"""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.checkpoint_io import CheckpointReader
    from loongforge_hf.bridges.loader import load_into

    with CheckpointReader(folder) as reader:
        dbrx = model.config.model_type == "dbrx"
        recording = _RecordingReader(reader, model.bridge.expert_ffn_size() if dbrx else 0)
        load_into(model.megatron, model.bridge, recording, tp_rank=ps.get_tensor_model_parallel_rank(),
                  tp_size=ps.get_tensor_model_parallel_world_size())
    read = sorted({int(m.group(1) or m.group(2)) for n in recording.read
                   if (m := re.search(r"\.experts\.(\d+)\.|#expert(\d+)$", n))})
    experts = [m for chunk in model.megatron.chunks for n, m in chunk.named_modules() if n.endswith("mlp.experts")]
    core = [m for chunk in model.megatron.chunks for n, m in chunk.named_modules() if n.endswith("core_attention")]
    norms = [m for chunk in model.megatron.chunks for n, m in chunk.named_modules()
             if n.endswith(("layernorm", "final_layernorm"))]
    return {"experts_read": read, "local_experts": sorted({m.num_local_experts for m in experts}),
            "core_attention": sorted({type(m).__name__ for m in core}),
            "norms": sorted({type(m).__name__ for m in norms if type(m).__name__ != "IdentityOp"}),
            "rope_fusion": model.megatron.config.apply_rope_fusion,
            "dispatcher": model.megatron.config.moe_token_dispatcher_type,
            "dispatcher_classes": sorted({type(m.token_dispatcher).__name__ for chunk in model.megatron.chunks
                                          for m in chunk.modules() if hasattr(m, "token_dispatcher")}),
            "mlp_modules": sorted({type(m).__name__ for chunk in model.megatron.chunks for n, m in chunk.named_modules()
                                   if n.endswith(".mlp")}),
            "experts_module": sorted({type(m).__name__ for m in experts}), "num_experts": model.bridge.num_experts(),
            "ep_rank": ps.get_expert_model_parallel_rank()}


def _one(folder: str, layout: dict, out_dir: str, seq: int, name: str = "") -> dict:
    """``layout`` may carry ``moe_grouped_gemm`` (False: megatron's SequentialMLP, through the environment); ``name``:
    the case's (``DSA_GENERATE``)."""
    import loongforge_hf as lf
    from loongforge_hf.bridges.moe import GROUPED_GEMM_ENV
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    layout = dict(layout)
    grouped = layout.pop("moe_grouped_gemm", True)
    os.environ[GROUPED_GEMM_ENV] = "1" if grouped else "0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = lf.AutoModelForCausalLM.from_pretrained(folder, dtype="auto", output_loading_info=True,
                                                              **layout)
    os.environ.pop(GROUPED_GEMM_ENV)
    ref, ref_info = hf_causal_lm(folder, dtype="auto", output_loading_info=True)
    experts = _expert_reads(model, folder)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    # NOTE: DeepSeek's, GLM-4.5's, dots.llm1's, HunYuan-MoE's, Cohere2-MoE's and AFMoE's router_logits (transformers
    # adds no aux loss for them, so the loss compares as before); ERNIE 4.5 MoE's, OLMoE's, PhiMoE's, Qwen3-Next's and
    # Qwen3.5-MoE's with transformers' balancing loss (its coefficient times it in the loss)
    routed = {"output_router_logits": True} if model.config.model_type.startswith(
        ("deepseek", "glm4_moe", "ernie4_5_moe", "olmoe", "llama4", "qwen3_next", "qwen3_5_moe",
         "minimax_m2", "dots1", "hunyuan_v1_moe", "flex_olmo", "phimoe", "cohere2_moe", "afmoe",
         "mistral4", "exaone_moe", "solar_open", "glm_moe_dsa", "dbrx", "mimo_v2_flash",
         "kimi_linear", "hy_v3", "mellum", "flint", "granitemoe_swa", "axk1", "axk2", "minimax", "kolibri1",
         "aria_text", "laguna", "lara_mini")) else {}
    out = model(input_ids=ids, labels=labels, **routed)
    with torch.no_grad():
        exp = ref(input_ids=ids, labels=labels, **routed)
    grads_ok = None
    if layout.get("pipeline_parallel_size", 1) == 1:
        out.loss.backward()
        # NOTE: frozen parameters take none (the DSA indexer's, as transformers' no_grad indexer)
        grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                       if p.requires_grad)
    sparse = model.config.model_type in ("deepseek_v32", "glm_moe_dsa", "axk2")  # NOTE: DeepSeek Sparse Attention
    # NOTE: left padding: DSA's indexer and attention skip the padded keys; MiniMax's lightning layers zero them
    padded = _left_padded_diff(model, ref, ids) if sparse or model.config.model_type == "minimax" else None
    minimax = model.config.model_type == "minimax"
    packed, generated = (_packed_diffs(model, ref), _generate_matches(model, ref)) if minimax else (None, None)
    if name in DSA_GENERATE:
        generated = _dsa_generate(model, ref)
    model.save_pretrained(out_dir, max_shard_size="50KB")
    return {"padded_diff": padded, "packed_diffs": packed, "generate_matches": generated,
            "loading_info": (info, ref_info),
            "logit_diff": (out.logits.float() - exp.logits.float()).abs().max().item(), "dtype": str(model.dtype),
            "loss_diff": abs(out.loss.item() - exp.loss.item()), "loss": out.loss.item(),
            "ref_loss": exp.loss.item(), "grads_ok": grads_ok, "logits_shape": tuple(out.logits.shape),
            "warnings": [str(w.message) for w in caught], **experts, **_router_outputs(out, exp)}


def _left_padded_diff(model, ref, ids) -> float:
    """The largest logit difference at the real tokens of a batch whose first row starts with 5 pads (sparse
    attention's indexer and attention both skip the padded keys)."""
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        out, exp = model(input_ids=ids, attention_mask=mask), ref(input_ids=ids, attention_mask=mask)
    return (out.logits - exp.logits)[mask.bool()].abs().max().item()


def _packed_diffs(model, ref, lengths: tuple[int, ...] = (7, 9, 4)) -> list[float]:
    """A row packing documents of ``lengths`` tokens (position ids restarting at 0): each document's largest logit
    difference from transformers' run of it alone (MiniMax's lightning layers restart at each document)."""
    ids = torch.randint(4, model.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    diffs, start = [], 0
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
        for n in lengths:
            alone = ref(input_ids=ids[:, start:start + n]).logits[0]
            diffs.append((packed[start:start + n] - alone).abs().max().item())
            start += n
    return diffs


def _generate_matches(model, ref) -> dict:
    """MiniMax: whether greedy generate of a left-padded batch with the cache and a 2-beam search (the lightning
    layers' states in the cache, reordered with the beams) give transformers' tokens."""
    ids = torch.randint(4, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3], ids[0, :3] = 0, 0
    out = {}
    # NOTE: under CP without the cache (the split prefill cannot fill the lightning states: refused by name)
    cached = {"use_cache": False} if model.parallel.context_parallel_size > 1 else {}
    for name, kw in {"greedy": {}, "beams": {"num_beams": 2}}.items():
        args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
        out[name] = torch.equal(model.generate(ids, **args, **cached), ref.generate(ids, **args))
    if cached:
        try:
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
            out["cached_refusal"] = ""
        except ValueError as err:
            out["cached_refusal"] = str(err)
    return out


def _dsa_generate(model, ref) -> dict:
    """DeepSeek Sparse Attention: greedy generate and a 2-beam search of a left-padded batch (prompts of 6 and 9
    tokens: longer than the tiny index_topk 4, so the top-k drops keys from the prefill on) with the KV cache, whether
    their tokens are transformers' (with its cache) and our own without the cache; each cache layer's type, keys'
    and indexer keys' shapes after the greedy run; ``logit_diff``: the largest difference of the steps' logits from
    transformers' (with its cache), over both runs."""
    ids = torch.randint(4, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3], ids[0, :3] = 0, 0
    out, diffs = {}, []
    # NOTE: under CP the cache is whole on each rank (the prompt's split prefill fills it; a sharded one is refused)
    whole = {"cp_kv_cache": "replicated"} if model.parallel.context_parallel_size > 1 else {}
    for name, kw in {"greedy": {}, "beams": {"num_beams": 2}}.items():
        args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
        cached = model.generate(ids, return_dict_in_generate=True, output_logits=True, **whole, **args)
        theirs = ref.generate(ids, return_dict_in_generate=True, output_logits=True, **args)
        diffs += [(a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("inf")
                  for a, b in zip(cached.logits, theirs.logits)]
        theirs = theirs.sequences
        out[name] = {"transformers": torch.equal(cached.sequences, theirs),
                     "uncached": torch.equal(model.generate(ids, use_cache=False, **args), theirs)}
        if name == "greedy":
            out["cache_layers"] = [(type(layer).__name__, tuple(layer.keys.shape),
                                    None if layer.index_keys is None else tuple(layer.index_keys.shape))
                                   for layer in cached.cache.layers]
    out["logit_diff"] = max(diffs)
    if whole:  # NOTE: the default cp_kv_cache="sharded" is refused on every rank before the prefill
        try:
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
            out["sharded_refusal"] = ""
        except ValueError as err:
            out["sharded_refusal"] = str(err)
    return out


def _router_outputs(out, exp) -> dict:
    """The output types, ``aux_loss`` and ``router_logits`` of ours (``out``) and transformers' (``exp``)."""
    ours, theirs = out.get("router_logits") or (), exp.get("router_logits") or ()
    diffs = [(a.detach().float() - b.float()).abs().max().item() if a.shape == b.shape else float("inf")
             for a, b in zip(ours, theirs)]
    aux, ref_aux = out.get("aux_loss"), exp.get("aux_loss")
    return {"output_type": type(out).__name__, "ref_output_type": type(exp).__name__,
            "no_aux_loss": aux is None, "router_counts": (len(ours), len(theirs)),
            "aux_diff": None if aux is None or ref_aux is None else abs(aux.item() - ref_aux.item()),
            "router_dtypes": sorted({str(t.dtype) for t in ours}), "router_diff": max(diffs, default=None)}


def _expect_layout_error(folder: str, layout: dict) -> dict:
    """from_pretrained must refuse the layout before the process group starts."""
    import torch.distributed as dist

    import loongforge_hf as lf

    try:
        lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    except Exception as err:  # noqa: BLE001 - the test checks type and message
        return {"type": type(err).__name__, "message": str(err), "collective_started": dist.is_initialized()}
    return {"type": "no error", "message": "", "collective_started": dist.is_initialized()}


def run_plan(plan: list[tuple[str, dict, list[tuple[str, str, str]]]], seq: int = 12,
             bad_layout: tuple[str, dict] | None = None) -> dict:
    """{layout name: {case name: result}} for each (layout name, layout, [(case, checkpoint, export folder)]).

    ``bad_layout`` (checkpoint, layout) is tried first, while no process group exists yet."""
    results: dict = {}
    if bad_layout is not None:
        results["bad_layout"] = _expect_layout_error(*bad_layout)
    for layout_name, layout, cases in plan:
        results[layout_name] = {name: _one(folder, layout, out_dir, seq, name=name)
                                for name, folder, out_dir in cases}
    return results
