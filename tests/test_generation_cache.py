"""``generate()`` with the KV cache (``loongforge_hf/kv_cache.py``) against transformers' ``generate`` with its default
dynamic cache and against our own ``use_cache=False`` path, on tiny fp32 checkpoints and a left-padded batch of two
prompts of different lengths.

- Greedy (scores and raw logits), beam search (3 beams, 2 sequences returned, scores) and seeded top-k sampling (logits)
  give transformers' tokens, and scores / logits within 1e-5 of transformers' and of ``use_cache=False``'s, on every
  rank of: one rank, TP2, TP2 with sequence parallelism (a one-token step padded to two), PP2, PP2 x VPP2 (a rank's
  cache spans its two virtual chunks), Qwen3-MoE with EP2, CP2 (the prefill is split over CP, its keys and values
  gathered and each rank's round-robin share kept in its cache; later cached steps run whole on both CP ranks, each
  attending over its share, the shares merged; uncached ones are split over CP: each rank's cache holds its share of the
  positions, the static cache's buffers its share and a scratch slot) and DeepSeek-V3 (MLA: its own rotary embedding,
  query / key and value heads of different sizes) with TP2 and sequence parallelism, and with CP2; Mistral with a
  3-token sliding window (the prompts and the generated tokens outrun it) at one rank and at CP2 (the window in the
  split prefill and over each rank's share); Phi-3 (packed q / k / v, partial rotary) with a 3-token window at TP2;
  StarCoder2 (LayerNorms and linears with biases, an ungated MLP) with a 3-token window at TP2 with sequence
  parallelism; GPT-NeoX (the attention and the MLP side by side, partial rotary) at PP2; Cohere (one LayerNorm before
  the attention and the MLP side by side, interleaved rotary pairs, per-head q / k norms split over TP, scaled logits)
  at TP2 with sequence parallelism; Cohere2 with a 3-token window on layers 0-2 and a full layer without rotary
  embedding at CP2; Phi (one LayerNorm before the attention and the MLP side by side, partial rotary, the LM head's
  bias over the vocabulary split) at TP2 with sequence parallelism; GPT-J (the same, part of each head rotated in
  interleaved pairs, biases on the MLP only) at TP2 with sequence parallelism; StableLM (the attention and the MLP side
  by side, per-head q / k LayerNorms, a quarter of each head rotated, GQA) at CP2;
  GLM-4.5 (biased q/k/v, half-rotary heads, sigmoid-routed experts) at TP2 with sequence parallelism; ERNIE 4.5 MoE
  (interleaved rotary pairs, tied embeddings, experts chosen on softmax scores plus a fixed bias) at TP2 with sequence
  parallelism and at CP2; OLMoE (q / k norms over all heads, split over TP with the heads; every layer sparse) at TP2
  with sequence parallelism and at CP2; Llama 4 (5-position attention chunks that the prompts and new tokens cross,
  a NoPE layer's query temperature by slot, sigmoid top-1 experts) at EP2; Phi-3 with LongRoPE (prompts and new
  tokens within its 32 short-factor positions) at one rank; SmolLM3 (layers 1 and 3 without rotary embedding, one on
  each stage) at PP2; Qwen3 with YaRN at one rank; Falcon (40B's two LayerNorms side by side, two KV groups fused
  group by group, biases, tied embeddings) at TP2 with sequence parallelism and Falcon-7B's multi-query attention
  (one KV head cached) at one rank; GPT-2 (learned absolute positions: the left-padded rows' counted from their first
  real token, as transformers' generate counts them) at CP2 and at TP2 with sequence parallelism; GPTBigCode
  (StarCoder: GPT-2's layer with nn.Linear weights) with multi-query attention at CP2 and without it at TP2 with
  sequence parallelism; dots.llm1 (per-head q / k norms, sigmoid-routed experts with a fixed bias, a 3-token window
  on its last two layers) at CP2; OLMo (q / k / v clamped by ``clip_qkv``, which binds; norms without parameters) at
  TP2 with sequence parallelism.
- After the prefill each cached forward runs the new token only (padded to TP under sequence parallelism), where
  ``use_cache=False`` runs the whole sequence so far: a return to the O(n^2) path fails here. The output layer
  computes the kept (last) position's logits only where that is exact (not under sequence parallelism).
- Four-rank products (PP2 x CP2, TP2 + SP x CP2, PP2 x VPP2 x CP2; the first two again with the CP-sharded
  cache) were run by hand (not in CI: four
  processes on the CI's two cores), same checks.
- ``return_dict_in_generate`` returns the ``LoongKVCache`` holding every position but the last token's.
- ``cache_implementation="static"`` (``loongforge_hf/static_cache.py``) gives transformers' tokens and scores / logits
  within 1e-5 in every layout above but EP (refused there); its one-token steps run the fixed-shape decode (what a
  GPU captures as a CUDA graph: ``test_generation_gpu.py``) in every layout without a pipeline (under sequence
  parallelism padded to TP as above, under CP whole on both ranks over their shares), the dynamic cache's path
  under pipelines.
- Refused on every rank alike (ValueError): a cache passed in, ``cache_implementation='offloaded'``,
  ``prefill_chunk_size``, a static cache with EP; ``forward`` refuses a transformers cache (TypeError).
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_models import PHI3_LONGROPE

from ._generation import (CACHE_PROMPTS, CACHE_SCENARIOS, REUSE, assert_refused_alike, assert_same_generation,
                          cache_run, static_reuse_run, transformers_reference)

ATOL = 1e-5
LAYOUTS = {
    "tp1": ("qwen2", 1, {}),
    "tp2": ("qwen2", 2, {"tensor_parallel_size": 2}),
    "tp2_sp": ("qwen2", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "pp2": ("qwen2", 2, {"pipeline_parallel_size": 2}),
    "pp2_vpp2": ("qwen2", 2, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}),
    "moe_ep2": ("qwen3_moe", 2, {"expert_parallel_size": 2}),
    "mla_tp2_sp": ("deepseek_v3", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "cp2": ("qwen2", 2, {"context_parallel_size": 2}),
    "mla_cp2": ("deepseek_v3", 2, {"context_parallel_size": 2}),
    "sliding_window": ("mistral_window", 1, {}),
    "sliding_window_cp2": ("mistral_window", 2, {"context_parallel_size": 2}),
    "phi3_tp2": ("phi3", 2, {"tensor_parallel_size": 2}),
    "glm4_moe_tp2_sp": ("glm4_moe", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "phi3_longrope": ("phi3_longrope", 1, {}),
    "smollm3_pp2": ("smollm3", 2, {"pipeline_parallel_size": 2}),
    "qwen3_yarn": ("qwen3_yarn", 1, {}),
    "gemma3_tp2_sp": ("gemma3", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "gemma3_cp2": ("gemma3", 2, {"context_parallel_size": 2}),
    "qwen3_moe_yarn_ep2": ("qwen3_moe_yarn", 2, {"expert_parallel_size": 2}),
    "granite_pp2": ("granite", 2, {"pipeline_parallel_size": 2}),
    "olmo2_tp2_sp": ("olmo2", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "olmo3_cp2": ("olmo3", 2, {"context_parallel_size": 2}),
    "gemma_tp2": ("gemma", 2, {"tensor_parallel_size": 2}),
    "gemma2_tp2_sp": ("gemma2", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "ministral_cp2": ("ministral", 2, {"context_parallel_size": 2}),
    "helium_tp2": ("helium", 2, {"tensor_parallel_size": 2}),
    "gpt_oss_ep2": ("gpt_oss", 2, {"expert_parallel_size": 2}),
    "glm4_tp2_sp": ("glm4", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "granitemoe_tp2_sp": ("granitemoe", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "exaone4_cp2": ("exaone4", 2, {"context_parallel_size": 2}),
    "starcoder2_tp2_sp": ("starcoder2", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "gpt_neox_pp2": ("gpt_neox", 2, {"pipeline_parallel_size": 2}),
    "cohere_tp2_sp": ("cohere", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "cohere2_cp2": ("cohere2", 2, {"context_parallel_size": 2}),
    "phi_tp2_sp": ("phi", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "gptj_tp2_sp": ("gptj", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "stablelm_cp2": ("stablelm", 2, {"context_parallel_size": 2}),
    "gpt_oss_cp2": ("gpt_oss", 2, {"context_parallel_size": 2}),
    "gpt_oss_tp2_sp": ("gpt_oss", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "ernie4_5_moe_tp2_sp": ("ernie4_5_moe", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "ernie4_5_moe_cp2": ("ernie4_5_moe", 2, {"context_parallel_size": 2}),
    "olmoe_tp2_sp": ("olmoe", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "olmoe_cp2": ("olmoe", 2, {"context_parallel_size": 2}),
    "falcon_tp2_sp": ("falcon", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "falcon_mqa": ("falcon_mqa", 1, {}),
    # NOTE: learned absolute positions: generate's (from each row's first real token) in the split prefill, the
    # steps run whole on both CP ranks and the fixed step; after the layout's padding under SP
    "gpt2_cp2": ("gpt2", 2, {"context_parallel_size": 2}),
    "gpt2_tp2_sp": ("gpt2", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    # NOTE: GPTBigCode (StarCoder): learned positions with multi-query attention (one KV head cached, CP-sharded), and
    # without multi_query under SP
    "gpt_bigcode_cp2": ("gpt_bigcode", 2, {"context_parallel_size": 2}),
    "gpt_bigcode_mha_tp2_sp": ("gpt_bigcode_mha", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    # NOTE: chunked attention (5 positions: the left-padded prompts and new tokens cross chunks), a NoPE layer's query
    # temperature by slot; EP: the static cache and the CP-sharded one refuse chunked attention
    "llama4_ep2": ("llama4", 2, {"expert_parallel_size": 2}),
    # NOTE: OLMo's q / k / v clamped (binding) in the prefill and the one-token steps, its norms without parameters
    "olmo_tp2_sp": ("olmo", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "dots1_cp2": ("dots1", 2, {"context_parallel_size": 2}),
    # NOTE: HunYuan rotates by position ids (its q / k norms after the rotation see the absolute angle): generate's,
    # from each row's first real token, in the CP split prefill and the steps
    "hunyuan_v1_moe_cp2": ("hunyuan_v1_moe", 2, {"context_parallel_size": 2}),
}
# NOTE: name -> (architecture, config overrides); Mistral with a 3-token sliding window: the prompts (6 positions)
# and every generated token outrun it
CHECKPOINTS = {"qwen2": ("qwen2", {}), "qwen3_moe": ("qwen3_moe", {}), "deepseek_v3": ("deepseek_v3", {}),
               "mistral_window": ("mistral", {"sliding_window": 3}), "phi3": ("phi3", {"sliding_window": 3}),
               "glm4_moe": ("glm4_moe", {}), "phi3_longrope": ("phi3", PHI3_LONGROPE),
               "smollm3": ("smollm3", {}), "gemma3": ("gemma3", {"sliding_window": 3}),
               "granite": ("granite", {}), "olmo2": ("olmo2", {}),
               "olmo3": ("olmo3", {"sliding_window": 3}), "gemma": ("gemma", {}),
               "gemma2": ("gemma2", {"sliding_window": 3}), "ministral": ("ministral", {"sliding_window": 3}),
               "helium": ("helium", {}), "gpt_oss": ("gpt_oss", {"sliding_window": 3}), "glm4": ("glm4", {}),
               "granitemoe": ("granitemoe", {}), "exaone4": ("exaone4", {"sliding_window": 3}),
               "starcoder2": ("starcoder2", {"sliding_window": 3}), "gpt_neox": ("gpt_neox", {}),
               "cohere": ("cohere", {}), "cohere2": ("cohere2", {"sliding_window": 3}), "phi": ("phi", {}),
               "gptj": ("gptj", {}), "stablelm": ("stablelm", {}), "falcon": ("falcon", {}),
               "falcon_mqa": ("falcon_mqa", {}), "gpt2": ("gpt2", {}),
               "gpt_bigcode": ("gpt_bigcode", {}), "gpt_bigcode_mha": ("gpt_bigcode_mha", {}),
               "ernie4_5_moe": ("ernie4_5_moe", {}), "olmoe": ("olmoe", {}), "llama4": ("llama4", {}),
               "olmo": ("olmo", {}),
               "dots1": ("dots1", {"sliding_window": 3}), "hunyuan_v1_moe": ("hunyuan_v1_moe", {}),
               "qwen3_yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                            "original_max_position_embeddings": 32}}),
               "qwen3_moe_yarn": ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                                    "factor": 4.0,
                                                                    "original_max_position_embeddings": 32}})}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    found = {}
    for name, (arch, overrides) in CHECKPOINTS.items():
        folder = make_tiny_checkpoint(tmp_path_factory.mktemp("gen_cache") / name, arch, **overrides)
        found[name] = (str(folder), transformers_reference(str(folder), CACHE_PROMPTS, CACHE_SCENARIOS))
    return found


def _same(got: dict, ref: dict, what: str) -> None:
    assert_same_generation(got, ref, what, atol=ATOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_generate_as_transformers_and_uncached(checkpoints, layout):
    arch, nprocs, sizes = LAYOUTS[layout]
    folder, ref = checkpoints[arch]
    results = run_distributed(cache_run, nprocs, folder, sizes, timeout=240)
    prompt = ref["greedy"]["sequences"].shape[1] - CACHE_SCENARIOS["greedy"]["max_new_tokens"]
    static = sizes.get("expert_parallel_size", 1) == 1
    cp = sizes.get("context_parallel_size", 1)
    for rank, res in enumerate(results):
        for name in CACHE_SCENARIOS:
            _same(res["cached"][name], ref[name], f"{layout} rank {rank} {name} cached vs transformers")
            _same(res["cached"][name], res["uncached"][name], f"{layout} rank {rank} {name} cached vs uncached")
            if static:
                _same(res["static"][name], ref[name], f"{layout} rank {rank} {name} static vs transformers")
        # NOTE: max_new_tokens=4: the prefill, then three one-token steps, padded for sequence parallelism; under CP
        # the prefill and the uncached forwards are split over CP (2 x CP chunks, half of them a rank's), the
        # later cached steps run whole on every CP rank
        step, multiple = res["cached_multiple"], res["multiple"]
        prefill = -(-prompt // multiple) * multiple // cp
        assert res["lengths"]["default"] == [prefill] + [step] * 3, res["lengths"]
        assert res["lengths"]["uncached"] == [-(-n // multiple) * multiple // cp for n in range(prompt, prompt + 4)]
        assert res["cache_out"] == ("LoongKVCache", prompt + 3)
        # NOTE: under CP each rank holds its round-robin share of the cached positions (kv_cache.CPShard), every layer
        assert res["cache_keys"] == [(len(range(rank % cp, prompt + 3, cp)),) * len(res["cache_keys"][0])], res
        # NOTE: the output layer computes the last position's logits only (logits_to_keep=1), except under sequence
        # parallelism, where its input is this rank's sequence slice (the logits are cut after it there); in a
        # prefill split over CP only the CP rank holding the last position computes it (ranks r hold chunks r and
        # 2 x CP - 1 - r of the padded prompt), the group adds the ranks' rows up
        whole = step > 1
        first = prefill if whole else 1
        if cp > 1 and not whole:
            chunk = prefill // 2
            first = int((prompt - 1) // chunk in (rank, 2 * cp - 1 - rank))  # NOTE: the CP rank is the rank here
        assert res["head_rows"] == ([first] + [step if whole else 1] * 3 if res["has_head"] else []), res["head_rows"]
        assert any(r["has_head"] for r in results)
        if static:
            assert res["lengths"]["static"] == res["lengths"]["default"], res["lengths"]
            # NOTE: (kind, tokens cached, max_cache_len = max_length - 1, steps run by the fixed-shape decode: those
            # after the prefill where there is no pipeline; the same padded lengths as the dynamic cache's, above)
            # NOTE: the fixed decode step takes no score soft-capping: Gemma 2's steps run as the dynamic cache's
            fixed = 3 if "pipeline_parallel_size" not in sizes and arch != "gemma2" else 0
            # NOTE: buffer slots: under CP the rank's share of max_cache_len and a scratch slot (static_cache.py)
            slots = len(range(rank % cp, prompt + 3, cp)) + 1 if cp > 1 else prompt + 3
            assert res["static_cache_out"] == ("LoongStaticCache", prompt + 3, prompt + 3, fixed, slots), res
            assert res["static_freed"], "the cache outlives the output (a cycle) or its buffers free_static_cache"
        else:
            assert "expert parallelism" in res["refused"]["static_ep"][1], res["refused"]
        assert res["forward_user_cache"][0] == "TypeError" and "LoongKVCache" in res["forward_user_cache"][1]
    assert_refused_alike(results, ("user_cache", "cache_implementation", "prefill_chunk_size"))
    assert "own KV cache" in results[0]["refused"]["user_cache"][1]


def _random_draws_world(folder: str) -> dict:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    import loongforge_hf as lf
    from loongforge_hf.static_cache import _draws_random, _no_rng_fork, graph_refusal

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    seen = {"eval": _draws_random(model)}
    model.train()
    seen["train, no dropout"] = _draws_random(model)
    model.megatron.config.hidden_dropout = 0.1
    seen["train, hidden dropout"] = _draws_random(model)
    tracker = get_cuda_rng_tracker()
    with _no_rng_fork():
        seen["fork inside"] = type(tracker.fork()).__name__
    seen["fork after"] = "fork" in vars(tracker)
    seen["cpu refusal"] = graph_refusal(model, draws_random=_draws_random(model))
    return seen


def test_random_draws_and_rng_forks(checkpoints):
    """The fixed step skips megatron's RNG forks (a CUDA graph cannot capture their generator swaps) only where the
    model draws nothing: eval mode, or training mode with every dropout at zero; a graph is refused otherwise."""
    seen = run_distributed(_random_draws_world, 1, checkpoints["qwen2"][0], timeout=120)[0]
    assert seen == {"eval": False, "train, no dropout": False, "train, hidden dropout": True,
                    "fork inside": "nullcontext", "fork after": False,
                    "cpu refusal": "the cpu backend has no device graphs"}, seen


def _ungraphed_world(folder: str) -> dict:
    import torch
    import transformers

    import loongforge_hf as lf
    from loongforge_hf import static_cache

    from ._generation import prompts_for, run_scenarios

    static_cache._backend_has_graphs = lambda: True  # NOTE: as on a GPU (a capture is never reached here)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    inputs = prompts_for(transformers.PreTrainedTokenizerFast.from_pretrained(folder), CACHE_PROMPTS)
    scenarios = {name: CACHE_SCENARIOS[name] for name in ("greedy", "beam")}
    out = model.generate(**inputs, max_new_tokens=4, cache_implementation="static", return_dict_in_generate=True)
    static = {name: {**kw, "cache_implementation": "static"} for name, kw in scenarios.items()}
    return {"dynamic": run_scenarios(model, inputs, scenarios), "static": run_scenarios(model, inputs, static),
            "cache": (out.cache.fixed_steps, out.cache.decode is None, out.cache.eager_refusal,
                      out.cache.get_seq_length())}


def test_static_cache_without_a_graph_runs_the_dynamic_step(checkpoints):
    """On a backend with device graphs (stood in for here), a model whose decode step cannot be captured (Qwen3-MoE
    in fp32: its experts loop over the routed counts on the host) runs its static-cache decode steps as the dynamic
    cache's over the static buffers, not the eager fixed step (slower on a GPU: docs/benchmarks.md): no fixed step
    made, the refusal kept for the call, and the dynamic cache's tokens and scores (1e-5) under greedy and beam
    search."""
    got = run_distributed(_ungraphed_world, 1, checkpoints["qwen3_moe"][0], timeout=180)[0]
    fixed, no_decode, refusal, cached = got["cache"]
    assert fixed == 0 and no_decode and "mixture-of-experts" in refusal and cached > 0, got["cache"]
    for name in got["dynamic"]:
        assert_same_generation(got["static"][name], got["dynamic"][name], name, atol=ATOL)


def _moe_refusal_world(folder: str) -> dict:
    import torch

    import loongforge_hf as lf
    from loongforge_hf import static_cache
    from loongforge_hf.kernels import grouped_mlp

    static_cache._backend_has_graphs = lambda: True
    # NOTE: as on CUDA, where bf16 expert stacks take torch._grouped_mm (this CPU process has no CUDA tensor)
    grouped_mlp.grouped_mm_supported = lambda x, fc1, fc2, **kw: {x.dtype, fc1.dtype, fc2.dtype} == {torch.bfloat16}

    def refusal(model):
        return static_cache.graph_refusal(model, draws_random=False)

    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        out[str(dtype)] = refusal(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype))
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    layers = [m for m in model.chunks[0].modules() if type(m).__name__ == "MoELayer"]
    layers[-1].token_dispatcher.sync_free = False
    out["megatron dispatcher"] = refusal(model)
    layers[-1].token_dispatcher.sync_free = True
    layers[0].experts.forward = layers[0].experts.forward  # NOTE: what an FP8 or adapter swap does
    out["experts forward swapped"] = refusal(model)
    del layers[0].experts.forward
    out["restored"] = refusal(model)
    out["layers"] = len(layers)
    return out


def test_moe_graph_refusal_at_fixed_shapes(checkpoints):
    """Which mixture-of-experts models' static-cache step may be captured as a device graph
    (``moe_permute.fixed_shape_moe``): bf16 grouped experts (``torch._grouped_mm``, stood in as on CUDA) behind the
    sync-free dispatcher with every expert local; refused in fp32 (the expert loop reads the counts on the host), with
    megatron's own dispatcher in any layer, or with an experts forward swapped in (FP8, adapters). The GPU capture
    itself: ``tests/test_generation_gpu.py::test_moe_bf16_static_cache_step_is_a_cuda_graph``."""
    got = run_distributed(_moe_refusal_world, 1, checkpoints["qwen3_moe"][0], timeout=180)[0]
    assert got["layers"] >= 2, got
    assert got["torch.bfloat16"] is None and got["restored"] is None, got
    for case in ("torch.float32", "megatron dispatcher", "experts forward swapped"):
        assert got[case] and "mixture-of-experts" in got[case], (case, got)


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp", "cp2"])
def test_static_cache_kept_across_calls(checkpoints, layout):
    """The static cache's buffers and fixed step (with its graph, on GPUs) are kept by the model: a later call with the
    same batch and a length that fits replays them; another batch, a longer call, new weight tensors or a hook make
    new ones (the host state changed), an in-place weight update does not; ``free_static_cache`` drops them. Every
    call gives the dynamic cache's tokens and scores (1e-5) on the model as it is then. CP2: the kept buffers hold
    each rank's share and its scratch slot (beam search reorders them in place)."""
    arch, nprocs, sizes = LAYOUTS[layout]
    results = run_distributed(static_reuse_run, nprocs, checkpoints[arch][0], sizes, timeout=240)
    for rank, found in enumerate(results):
        seen = found["calls"]
        assert found["copied_kept"] is None  # NOTE: a deep-copied model makes its own cache and graph
        assert {name: (got["reused"], got["max_cache_len"]) for name, got in seen.items()} == REUSE, (rank, seen)
        for name, got in seen.items():
            assert got["tokens_equal"] and got["scores_diff"] < ATOL, (rank, name, got)
            assert got["fixed_steps"] == {"shorter": 1, "longer": 5}.get(name, 3), (rank, name, got)


def _one_token_prompt_world(folder: str) -> dict:
    import torch

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    ids = torch.tensor([[5]])
    out = {}
    for impl in ("dynamic", "static"):
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                             output_scores=True, return_dict_in_generate=True,
                             cache_implementation=None if impl == "dynamic" else impl)
        out[impl] = (got.sequences, torch.stack(got.scores), [layer.keys.shape[2] for layer in got.cache.layers])
    return out


def test_one_token_prompt_under_cp2(checkpoints):
    """A one-token prompt under CP2: the second CP rank holds no key of it (its share of the cache starts empty) and
    the shares still merge to transformers' greedy tokens, scores within 1e-5, dynamic and static cache."""
    import torch
    import transformers

    folder = checkpoints["qwen2"][0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[5]])
    want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                        output_scores=True, return_dict_in_generate=True)
    for rank, res in enumerate(run_distributed(_one_token_prompt_world, 2, folder, timeout=240)):
        for impl, (sequences, scores, keys) in res.items():
            assert torch.equal(sequences, want.sequences), (rank, impl)
            torch.testing.assert_close(scores, torch.stack(want.scores), atol=ATOL, rtol=0)
            # NOTE: 5 positions cached (the prompt and 4 new tokens): slots 0, 2, 4 on rank 0, 1, 3 on rank 1; the
            # static buffers hold a rank's share of max_cache_len (5) and the scratch slot
            assert set(keys) == ({3 - rank} if impl == "dynamic" else {4 - rank}), (rank, impl, keys)


def _replicated_world(folder: str) -> dict:
    import torch
    import transformers

    import loongforge_hf as lf

    from ._generation import prompts_for, run_scenarios

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    inputs = prompts_for(transformers.PreTrainedTokenizerFast.from_pretrained(folder), CACHE_PROMPTS)
    out = {}
    for impl in ("dynamic", "static"):
        extra = {"cp_kv_cache": "replicated", **({"cache_implementation": impl} if impl == "static" else {})}
        out[impl] = run_scenarios(model, inputs, {k: {**v, **extra} for k, v in CACHE_SCENARIOS.items()})
        cache = model.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True, **extra).cache
        out[impl + " keys"] = sorted({layer.keys.shape[2] for layer in cache.layers})
    out["sharded after"] = sorted({layer.keys.shape[2] for layer in model.generate(
        **inputs, max_new_tokens=4, return_dict_in_generate=True, cache_implementation="static").cache.layers})
    try:
        model.generate(**inputs, max_new_tokens=2, cp_kv_cache="split")
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    return out


def test_cp2_replicated_cache(checkpoints):
    """``generate(cp_kv_cache="replicated")`` under CP2: every CP rank holds the whole cache (the static cache's
    buffers too: max_cache_len slots, no scratch one) and decode steps attend over it as on one rank; greedy, beam
    search and sampling give transformers' tokens and scores / logits within 1e-5, dynamic and static cache. A later
    static call with the default (sharded) makes new buffers of the rank's share; another value is refused."""
    folder, ref = checkpoints["qwen2"]
    prompt = ref["greedy"]["sequences"].shape[1] - CACHE_SCENARIOS["greedy"]["max_new_tokens"]
    for rank, res in enumerate(run_distributed(_replicated_world, 2, folder, timeout=240)):
        for impl in ("dynamic", "static"):
            for name in CACHE_SCENARIOS:
                _same(res[impl][name], ref[name], f"cp2 replicated rank {rank} {impl} {name}")
        # NOTE: the static buffers are the kept ones of the longest call before (greedy: 6 new tokens, max_cache_len
        # prompt + 5); the sharded call keeps that length and holds the rank's share of it and the scratch slot
        assert res["dynamic keys"] == [prompt + 3] and res["static keys"] == [prompt + 5], res
        assert res["sharded after"] == [len(range(rank, prompt + 5, 2)) + 1], res
        assert "cp_kv_cache must be 'sharded' or 'replicated'" in res["refused"], res


def _softcap_cp_generate(folder: str) -> str:
    import torch
    import torch.distributed as dist

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    try:
        model.generate(input_ids=torch.arange(4, 12)[None], max_new_tokens=3, do_sample=False)
        out = "no error"
    except ValueError as err:
        out = str(err)
    dist.barrier()  # NOTE: both ranks got here: nothing waits in a collective
    return out


def test_softcapped_scores_with_a_context_parallel_cache_refused(tmp_path):
    """Gemma 2's score soft-capping is not computed by the context-parallel cache's partial attention: generate at
    CP2 raises the same message on both ranks (no hang)."""
    folder = make_tiny_checkpoint(tmp_path / "gemma2", "gemma2")
    for message in run_distributed(_softcap_cp_generate, 2, str(folder), timeout=240):
        assert "soft-capping (Gemma 2) is not supported with a KV cache sharded over context-parallel" in message
