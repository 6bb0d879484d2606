"""Rank functions for tests/test_generation.py (module-level so spawned ranks can import them), and the transformers
reference they are compared with."""

from __future__ import annotations

import torch
import torch.distributed as dist

PROMPTS = ["tok5 tok6 tok7", "tok8 tok9 tok10 tok11 tok12", "tok13 tok14 tok15 tok16 tok17 tok18 tok19"]
SEED = 3
# NOTE: eos 180 is a token greedy decoding reaches in the second row only (test_eos_stops_some_rows checks it)
SCENARIOS = {
    "greedy": dict(max_new_tokens=8),
    "eos": dict(max_new_tokens=8, eos_token_id=180),
    "sample": dict(max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9, temperature=0.7,
                   return_dict_in_generate=True, output_logits=True),
    "beam": dict(max_new_tokens=5, num_beams=2, num_return_sequences=2, return_dict_in_generate=True,
                 output_scores=True),
    "beam_sample": dict(max_new_tokens=4, num_beams=2, do_sample=True, top_k=10),
}
REFUSED = {
    "output_attentions": dict(output_attentions=True, return_dict_in_generate=True),
    "output_hidden_states": dict(output_hidden_states=True, return_dict_in_generate=True),
    "offloaded_cache": dict(cache_implementation="offloaded_static"),
    "prompt_lookup": dict(prompt_lookup_num_tokens=2),
    "group_beam": dict(num_beams=2, num_beam_groups=2, diversity_penalty=1.0, trust_remote_code=True),
    "custom_generate": dict(custom_generate=lambda *a, **k: None),
}


def prompts_for(tokenizer, prompts=PROMPTS) -> dict:
    tokenizer.padding_side = "left"
    return dict(tokenizer(prompts, return_tensors="pt", padding=True))


def _plain(out) -> dict:
    """A generate output as plain tensors (sequences, and the scores / logits tuples stacked)."""
    if torch.is_tensor(out):
        return {"sequences": out}
    got = {"sequences": out.sequences}
    for key in ("scores", "logits"):
        if getattr(out, key, None) is not None:
            got[key] = torch.stack(getattr(out, key))
    for key in ("sequences_scores", "beam_indices"):
        if getattr(out, key, None) is not None:
            got[key] = getattr(out, key)
    return got


def run_scenarios(model, inputs: dict, scenarios: dict = SCENARIOS) -> dict:
    """{scenario: plain outputs} after ``transformers.set_seed(SEED)`` each, on any generate-capable model."""
    import transformers

    got = {}
    for name, kw in scenarios.items():
        transformers.set_seed(SEED)
        got[name] = _plain(model.generate(**inputs, **kw))
    return got


def transformers_reference(folder: str, prompts=PROMPTS, scenarios: dict = SCENARIOS) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    got = run_scenarios(model, prompts_for(tok, prompts), scenarios)
    if "sample" in scenarios:
        transformers.set_seed(SEED)
        model.generate(**prompts_for(tok, prompts), **scenarios["sample"])
        got["rng_after_sample"] = torch.get_rng_state()
    return got


def refusals(model, inputs: dict, refused: dict) -> dict:
    """{name: None, or (error type, message)} of ``generate(**inputs, max_new_tokens=2, **kw)`` for each of
    ``refused`` (``kw`` a dict, or a function of ``inputs`` giving one)."""
    found = {}
    for name, kw in refused.items():
        try:
            model.generate(**inputs, max_new_tokens=2, **(kw(inputs) if callable(kw) else kw))
            found[name] = None
        except Exception as err:  # noqa: BLE001 - the test checks the type
            found[name] = (type(err).__name__, str(err))
    return found


def assert_refused_alike(results: list, names) -> None:
    """Each of ``names`` (keys of every rank's ``refusals``) raised a ValueError, the same on every rank."""
    for name in names:
        got = results[0]["refused"][name]
        assert got is not None and got[0] == "ValueError", (name, got)
        assert all(res["refused"][name] == got for res in results), name


def assert_same_generation(got: dict, ref: dict, what: str, *, atol: float) -> None:
    """Equal sequences, the same output fields, and every other field within ``atol``."""
    assert torch.equal(got["sequences"], ref["sequences"]), (what, got["sequences"], ref["sequences"])
    assert set(got) == set(ref), (what, set(got), set(ref))
    for key in set(ref) - {"sequences"}:
        torch.testing.assert_close(got[key], ref[key], atol=atol, rtol=0, msg=lambda m: f"{what} {key}: {m}")


def generation_run(folder: str, layout: dict, *, lora: bool = False) -> dict:
    """This rank's outputs for every scenario, in eval and in training mode, plus refusals, the replica-mismatch
    error, the RNG states around sampling and, with ``lora``, LoRA against PEFT's model."""
    import transformers

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    inputs = prompts_for(tok)
    rank = dist.get_rank()
    res = {"eval": run_scenarios(model, inputs), "training_before": model.training}
    model.train()
    res["train_mode"] = run_scenarios(model, inputs, {"greedy": SCENARIOS["greedy"]})["greedy"]
    res["training_after"] = model.training
    model.eval()
    # sampling with the ranks' generators in step: they stay in step, where transformers' ends
    transformers.set_seed(SEED)
    model.generate(**inputs, **SCENARIOS["sample"])
    res["rng_in_step"] = torch.get_rng_state()
    # sampling with this rank's generator moved away from the first rank's: the first rank's draws are used
    transformers.set_seed(SEED)
    if rank > 0:
        torch.rand(rank + 2)
    before = torch.get_rng_state()
    res["sample_desynced"] = _plain(model.generate(**inputs, **SCENARIOS["sample"]))
    res["rng"] = (before, torch.get_rng_state())
    res["refused"] = refusals(model, inputs, REFUSED)
    if dist.get_world_size() > 1:
        try:
            model.generate(**inputs, max_new_tokens=3 + rank)
            res["mismatch"] = None
        except Exception as err:  # noqa: BLE001
            res["mismatch"] = (type(err).__name__, str(err))
    if lora:
        from tests.integrations._lora_checks import LORA_KW, lora_pair

        ours, _, theirs = lora_pair(folder, layout, LORA_KW)
        kw = SCENARIOS["greedy"]
        res["lora"] = (ours.generate(**inputs, **kw), theirs.generate(**inputs, **kw),
                       ours.generate(**inputs, **kw, cache_implementation="static"))
    return res


def data_parallel_run(folder: str, layout: dict, prompts_by_rank: list, scenarios_by_rank: list) -> dict:
    """Data-parallel ranks (world 2, one replica each) generating different prompts with different settings."""
    import transformers

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    rank = dist.get_rank()
    return run_scenarios(model, prompts_for(tok, prompts_by_rank[rank]), scenarios_by_rank[rank])


# a left-padded batch of two prompts of different lengths; greedy with scores and logits, beam search returning two
# of three beams, seeded sampling
CACHE_PROMPTS = ["tok5 tok6", "tok8 tok9 tok10 tok11 tok12 tok13"]
CACHE_SCENARIOS = {
    "greedy": dict(max_new_tokens=6, return_dict_in_generate=True, output_scores=True, output_logits=True),
    "beam": dict(max_new_tokens=4, num_beams=3, num_return_sequences=2, return_dict_in_generate=True,
                 output_scores=True),
    "sample": dict(max_new_tokens=5, do_sample=True, top_k=20, temperature=0.8, return_dict_in_generate=True,
                   output_logits=True),
}


def step_lengths(model, run) -> list:
    """The sequence lengths (padded for the layout) the model's first chunk sees in each forward of ``run()``."""
    seen = []
    handle = model.chunks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[-1]))
    try:
        run()
    finally:
        handle.remove()
    return seen


def head_rows_seen(model, run) -> list:
    """The positions each call of this rank's output layer (if it holds one) computed logits for during ``run()``."""
    from loongforge_hf.bridges.runtime import language_head

    head = language_head(model.chunks[-1])
    seen = []
    handle = head.output_layer.register_forward_hook(lambda module, args, out: seen.append(out[0].shape[0])) \
        if head is not None else None
    try:
        run()  # NOTE: on every rank: generate is collective
    finally:
        if handle is not None:
            handle.remove()
    return seen


def _static_cache_out(model, inputs: dict) -> tuple:
    """((kind, tokens cached, max_cache_len, fixed-shape steps, buffer slots) of a static-cache generate's returned
    cache after the model's kept buffers were freed, whether that cache goes as soon as the output does and its
    buffers at ``free_static_cache``, without the cycle collector)."""
    import gc
    import weakref

    gc.disable()
    try:
        model.free_static_cache()  # NOTE: else the buffers of a longer earlier call are reused (max_cache_len)
        out = model.generate(**inputs, max_new_tokens=4, cache_implementation="static", return_dict_in_generate=True)
        cache = out.cache
        seen = (type(cache).__name__, cache.get_seq_length(), cache.max_cache_len, cache.fixed_steps,
                cache.layers[0].keys.shape[2])
        ref, keys = weakref.ref(cache), weakref.ref(cache.layers[0].keys)
        del out, cache
        gone = ref() is None
        model.free_static_cache()
        return seen, gone and keys() is None
    finally:
        gc.enable()


def cache_run(folder: str, layout: dict) -> dict:
    """``CACHE_SCENARIOS`` with the KV cache (the default) and with ``use_cache=False``, the sequence lengths of the
    cached and uncached greedy forwards, and what the cache and a context-parallel layout refuse."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.bridges.runtime import language_head

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    inputs = prompts_for(tok, CACHE_PROMPTS)
    res = {"multiple": model.parallel.sequence_multiple, "lengths": {},
           "cached_multiple": model.parallel.whole_sequence_multiple}
    res["cached"] = run_scenarios(model, inputs, CACHE_SCENARIOS)
    if model.parallel.expert_parallel_size == 1:
        static = {k: {**v, "cache_implementation": "static"} for k, v in CACHE_SCENARIOS.items()}
        res["static"] = run_scenarios(model, inputs, static)
        res["static_cache_out"], res["static_freed"] = _static_cache_out(model, inputs)
        res["lengths"]["static"] = step_lengths(
            model, lambda: model.generate(**inputs, max_new_tokens=4, cache_implementation="static"))
    res["uncached"] = run_scenarios(model, inputs, {k: {**v, "use_cache": False} for k, v in CACHE_SCENARIOS.items()})
    greedy = dict(max_new_tokens=4)
    res["lengths"]["default"] = step_lengths(model, lambda: model.generate(**inputs, **greedy))
    res["lengths"]["uncached"] = step_lengths(model, lambda: model.generate(**inputs, **greedy, use_cache=False))
    res["head_rows"] = head_rows_seen(model, lambda: model.generate(**inputs, **greedy))
    res["has_head"] = language_head(model.chunks[-1]) is not None
    out = model.generate(**inputs, **greedy, return_dict_in_generate=True)
    res["cache_out"] = (type(out.cache).__name__, out.cache.get_seq_length() if out.cache is not None else None)
    res["cache_keys"] = sorted({tuple(layer.keys.shape[2] for layer in out.cache.layers)})  # NOTE: keys held here
    refused = {"user_cache": dict(cache=transformers.DynamicCache()),
               "cache_implementation": dict(cache_implementation="offloaded"),
               "static_ep": dict(cache_implementation="static"),
               "prefill_chunk_size": dict(prefill_chunk_size=2)}
    res["refused"] = refusals(model, inputs, refused)
    try:
        model(**inputs, cache=transformers.DynamicCache())
        res["forward_user_cache"] = None
    except Exception as err:  # noqa: BLE001
        res["forward_user_cache"] = (type(err).__name__, str(err))
    return res


# NOTE: static_reuse_run's calls -> (reused the kept fixed step, max_cache_len): the prompts are 6 positions, so 4 new
# tokens need 9 slots
REUSE = {"first": (False, 9), "again": (True, 9), "shorter": (True, 9), "beams": (False, 9),
         "after beams": (False, 9), "longer": (False, 11), "weights in place": (True, 11),
         "weights replaced": (False, 11), "hook added": (False, 11), "after free": (False, 9)}


def static_reuse_run(folder: str, layout: dict) -> dict:
    """A sequence of static-cache generate calls on one model: which reused the buffers and fixed step kept from the
    call before (``static_cache.Kept``), and their tokens against the dynamic cache's on the model as it was then;
    what a deep copy of the kept step is."""
    import copy

    import transformers

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    inputs = {k: v.to(model.device) for k, v in prompts_for(tok, CACHE_PROMPTS).items()}
    weight = next(p for name, p in model.named_parameters() if "linear_fc1" in name)
    seen = {}

    def call(name: str, new: int = 4, **kw) -> None:
        out = model.generate(**inputs, max_new_tokens=new, cache_implementation="static", return_dict_in_generate=True,
                             output_scores=True, **kw)
        ref = model.generate(**inputs, max_new_tokens=new, return_dict_in_generate=True, output_scores=True, **kw)
        cache = out.cache
        seen[name] = {"reused": cache.reused_kept_step, "max_cache_len": cache.max_cache_len,
                      "fixed_steps": cache.fixed_steps, "tokens_equal": torch.equal(out.sequences, ref.sequences),
                      "scores_diff": max(float((a - b).abs().max()) for a, b in zip(out.scores, ref.scores)),
                      "graphed": cache.graphed}

    call("first")
    call("again")
    call("shorter", new=2)
    call("beams", num_beams=3)  # NOTE: another batch (rows x beams): new buffers and step
    call("after beams")
    call("longer", new=6)
    with torch.no_grad():
        weight.mul_(-2.0)  # NOTE: in place, as an optimizer step: the kept step reads the new values
    call("weights in place")
    weight.data = weight.data.clone()  # NOTE: a new tensor: the kept step would read the old one
    call("weights replaced")
    handle = model.chunks[0].register_forward_pre_hook(lambda module, args: None)
    call("hook added")
    handle.remove()
    copied = copy.deepcopy(model.__dict__["_static_cache_kept"])  # NOTE: what copy.deepcopy(model) holds
    model.free_static_cache()
    call("after free")
    return {"calls": seen, "copied_kept": copied}
