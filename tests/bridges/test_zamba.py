"""Zamba2ForCausalLM (Mamba2 layers, three of them hybrid: two shared transformer blocks re-used in turn with per-use
q / k / v and MLP adapters, rope in the shared attention) and ZambaForCausalLM (multi-head Mamba-1 layers, two of them
hybrid with the one shared block) against transformers, fp32 within 1e-4, in one two-rank world:
- TP1 (data parallel over the two ranks): two 40-token rows, the second left-padded by 9, logits and loss; a row
  packing documents against each document alone; Zamba2's uncached greedy generate against transformers'; cached
  greedy and 2-beam generate of a left-padded batch against transformers' cache (each use of a shared block its
  own keys and values, the Mamba layers their conv / SSM states); a bit-exact export round trip (the shared blocks
  written once, under their first use, as transformers writes them);
- Zamba2's training forward with activation checkpointing refused;
- TP2 + SP: the padded rows' logits and loss, every parameter's gradient exported through the bridge against
  transformers' (each shared block's summed over its uses), cached greedy generate; LoRA on the Mamba layers'
  ``in_proj`` / ``out_proj`` against PEFT (logits, loss, every factor's gradient, the adapter folder in PEFT and
  the merged export in transformers: ``_lora_hybrids``); CP2: the padded rows, a row packing documents across the
  chunks and every gradient;
- refusals on the bridge alone (pure, before any collective), naming the field; LoRA on the shared blocks' linears
  refused by name by the planner (PEFT gives each use its own adapter)."""

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
ARCHS = ("zamba2", "zamba")
MAMBA_LORA = dict(r=4, lora_alpha=8, target_modules=["in_proj", "out_proj"], init_lora_weights=False)


def _ids(shape, seed=0):
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def _padded(ours, ref) -> dict:
    ids = _ids((2, 40))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    with torch.no_grad():
        got, want = ours(**kw), ref(**kw)
    return {"logits": float((got.logits - want.logits).abs()[mask.bool()].max()),
            "loss": float(abs(got.loss - want.loss))}


def _generate(ours, ref) -> tuple[bool, float]:
    ids = _ids((1, 8), seed=3)
    kw = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True, use_cache=False)
    got, want = ours.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw)
    return (torch.equal(got.sequences, want.sequences),
            max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))


def _cached_generate(ours, ref, beams: tuple[int, ...]) -> dict:
    """Cached generate (the default) of a left-padded batch of two (the second prompt 4 tokens shorter), greedy and
    with each of ``beams``: (sequences equal, largest score difference) against transformers' cache."""
    ids = _ids((2, 9), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = {}
    for n in (1, *beams):
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=n,
                  return_dict_in_generate=True, output_scores=True)
        got, want = ours.generate(**kw), ref.generate(**kw)
        out[n] = (torch.equal(got.sequences, want.sequences),
                  max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)),
                  sorted({type(layer).__name__ for layer in got.cache.layers}) if n == 1 else None)
    return out


def _gradients(ours, ref, folder: str) -> dict | None:
    """Every parameter's gradient after a backward (rank 0: relative to each tensor's largest; None elsewhere)."""
    import torch.distributed as dist

    from ._gradients import gradient_diffs, save_gradients

    ids = _ids((2, 24), seed=2)
    ours(input_ids=ids, labels=ids).loss.backward()
    save_gradients(ours, f"{folder}-grads")
    if dist.get_rank() != 0:
        return None
    ref.zero_grad(set_to_none=True)  # NOTE: a second call (CP2 after TP2) would add to the first's
    ref(input_ids=ids, labels=ids).loss.backward()
    return gradient_diffs(f"{folder}-grads", ref)


def _recompute_refusal(ours) -> str:
    """The message of a training forward with activation checkpointing (the model left in eval mode after)."""
    ours.train()
    ours.gradient_checkpointing_enable()
    try:
        ours(input_ids=torch.arange(4, 12)[None], labels=torch.arange(4, 12)[None])
    except ValueError as err:
        return str(err)
    finally:
        ours.gradient_checkpointing_disable()
        ours.eval()
    return "no error"


def _checks(folder: str, *, generate: bool) -> dict:
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.round_trip import check_round_trip

    from ..integrations._lora_hybrids import hybrid_lora_checks
    from .test_qwen3_5 import packed_against_alone

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {"tp1": _padded(ours, ref), "packed": packed_against_alone(ours, ref),
           "cached_tp1": _cached_generate(ours, ref, beams=(2,))}
    if generate:
        out["generate"] = _generate(ours, ref)
        out["recompute"] = _recompute_refusal(ours)
    ours.save_pretrained(f"{folder}-saved")  # NOTE: one folder for both ranks (rank 0 writes it)
    if dist.get_rank() == 0:
        check_round_trip(folder, f"{folder}-saved")
        out["round_trip"] = True
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                   sequence_parallel=True)
    out["tp2_sp"] = _padded(ours, ref)
    out["cached_tp2_sp"] = _cached_generate(ours, ref, beams=())
    out["grads"] = _gradients(ours, ref, folder)
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    out["cp2"] = _padded(ours, ref)
    out["cp2_packed"] = packed_against_alone(ours, ref)
    out["cp2_grads"] = _gradients(ours, ref, folder)
    del ours
    out["lora"] = hybrid_lora_checks(folder, f"{folder}-lora", dict(tensor_parallel_size=2, sequence_parallel=True),
                                     MAMBA_LORA)
    return out


def _world(folders: dict) -> dict:
    return {arch: _checks(folder, generate=arch == "zamba2") for arch, folder in folders.items()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("zamba")
    return {arch: str(make_tiny_checkpoint(root / arch, arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def world(folders):
    return run_distributed(_world, 2, folders, timeout=300)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["tp1", "tp2_sp"])
def test_logits_and_loss(world, arch, layout):
    for rank in world:
        assert rank[arch][layout]["logits"] < TOL and rank[arch][layout]["loss"] < TOL, rank[arch][layout]


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_and_round_trip(world, arch):
    assert max(world[0][arch]["packed"]) < TOL, world[0][arch]["packed"]
    assert world[0][arch]["round_trip"]


def test_uncached_generate(world):
    assert world[0]["zamba2"]["generate"][0] and world[0]["zamba2"]["generate"][1] < TOL, world[0]["zamba2"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["cached_tp1", "cached_tp2_sp"])
def test_cached_generate(world, arch, layout):
    """Greedy (and 2-beam at TP1) cached generate of a left-padded batch: the same tokens as transformers' cache,
    scores within 1e-4; the cache holds keys and values (one layer a use of a shared block) and the Mamba states."""
    for n, (same, diff, layers) in world[0][arch][layout].items():
        assert same and diff < TOL, (n, world[0][arch][layout])
        assert n > 1 or layers == ["DynamicLayer", "LinearAttentionLayer"], layers


@pytest.mark.parametrize("arch", ARCHS)
def test_mamba_lora_matches_peft_tp2_sp(world, arch):
    """LoRA on every layer's Mamba ``in_proj`` / ``out_proj`` (the hybrid layers' under ``mamba_decoder``) at TP2 +
    SP: logits within 1e-4, loss within 1e-5, gradients within 1e-4 (relative), the adapter folder in PEFT and the
    merged export in transformers within 1e-4 (``_lora_hybrids.check_matches_peft``)."""
    from ..integrations._lora_hybrids import check_matches_peft

    check_matches_peft([rank[arch]["lora"] for rank in world], targets=10)


def test_recompute_refused(world):
    """The shared blocks and embeddings pass beside megatron's layer arguments: activation checkpointing refused."""
    assert "activation checkpointing (recompute) is not supported" in world[0]["zamba2"]["recompute"], world[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_tp2_sp(world, arch):
    grads = world[0][arch]["grads"]
    assert any("shared_transf" in n for n in grads), sorted(grads)
    assert arch == "zamba" or any("adapter_list" in n for n in grads), sorted(grads)
    bad = {n: d for n, d in grads.items() if d > TOL}
    assert not bad, bad


@pytest.mark.parametrize("arch", ARCHS)
def test_context_parallel(world, arch):
    """CP2: the Mamba2 scan's (Zamba2) or each Mamba-1 head's (Zamba) states passed over the CP group, the convs after
    their halo, each use's core attention gathering the keys and values: the padded rows' logits and loss, a row
    packing documents across the chunks, every parameter's gradient (each shared block's summed over its uses)."""
    for rank in world:
        assert rank[arch]["cp2"]["logits"] < TOL and rank[arch]["cp2"]["loss"] < TOL, rank[arch]["cp2"]
        assert max(rank[arch]["cp2_packed"]) < TOL, rank[arch]["cp2_packed"]
    grads = world[0][arch]["cp2_grads"]
    assert any("shared_transf" in n for n in grads), sorted(grads)
    assert arch == "zamba" or any("adapter_list" in n for n in grads), sorted(grads)
    bad = {n: d for n, d in grads.items() if d > TOL}
    assert not bad, bad


@pytest.mark.parametrize("changes, layout, field", [
    ({"tie_word_embeddings": False}, None, "tie_word_embeddings=False is not supported for Zamba2ForCausalLM"),
    ({"add_bias_linear": True}, None, "add_bias_linear=True is not supported for Zamba2ForCausalLM"),
    ({"use_long_context": True}, None, "use_long_context=True is not supported for Zamba2ForCausalLM"),
    ({"layers_block_type": ["linear_attention", "full_attention"] * 2 + ["hybrid"]}, None,
     "layers_block_type ['full_attention'] is not supported for Zamba2ForCausalLM"),
    ({}, dict(pipeline_parallel_size=2), "pipeline_parallel_size=2 is not supported for Zamba2ForCausalLM"),
    ({"num_key_value_heads": 1}, dict(tensor_parallel_size=2), "num_key_value_heads=1 does not split over "
     "tensor_parallel_size=2 for Zamba2ForCausalLM")])
def test_refused(folders, changes, layout, field):
    """What megatron cannot run as transformers does is refused by the bridge alone (pure, before any collective),
    naming the field."""
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    config = transformers.AutoConfig.from_pretrained(folders["zamba2"])
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        get_bridge(config).check_layout(ParallelConfig(**(layout or {})))


def test_static_cache_refused(folders):
    """The static cache's fixed-shape step keeps no Mamba state: refused by name; the dynamic cache taken."""
    import transformers

    from loongforge_hf.bridges import get_bridge

    for arch, name in (("zamba2", "Zamba2ForCausalLM"), ("zamba", "ZambaForCausalLM")):
        bridge = get_bridge(transformers.AutoConfig.from_pretrained(folders[arch]))
        refusal = bridge.generation_refusal(transformers.GenerationConfig(use_cache=True,
                                                                          cache_implementation="static"))
        assert refusal is not None and f"cache_implementation='static' is not supported for {name}" in refusal
        assert bridge.generation_refusal(transformers.GenerationConfig(use_cache=True)) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_block_lora_refused_by_name(folders, arch):
    """PEFT gives each use of a shared block (a tied copy in each hybrid layer) its own adapter, where megatron runs
    one linear for all the uses: the block's linears, the hybrid layers' ``linear`` and Zamba2's per-use adapters
    are refused by name; the ``'all-linear'`` the message suggests plans the Mamba linears."""
    import ast

    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folders[arch]))
    messages = {}
    for name, target_modules in (("q_proj", ["q_proj", "in_proj"]), ("down_proj", ["down_proj"]),
                                 ("linear", ["linear"]), ("all", "all-linear")):
        with pytest.raises(LoraConfigError, match="cannot carry a LoRA adapter") as err:
            plan_lora(bridge, peft.LoraConfig(r=4, target_modules=target_modules))
        messages[name] = str(err.value)
    shared, linear = "so PEFT gives each use its own adapter", "a plain replicated torch linear here"
    assert shared in messages["q_proj"] and shared in messages["down_proj"], messages
    assert linear in messages["linear"] and shared in messages["all"] and linear in messages["all"], messages
    excluded = ast.literal_eval(re.search(r"exclude_modules=(\[[^\]]*\])", messages["all"]).group(1))
    plan = plan_lora(bridge, peft.LoraConfig(r=4, target_modules="all-linear", exclude_modules=excluded))
    assert sorted({t.hf_module.rsplit(".", 1)[-1] for t in plan.targets}) == ["in_proj", "out_proj"]


@pytest.mark.parametrize("changes, layout, field", [
    ({"mamba_proj_bias": True}, None, "mamba_proj_bias=True is not supported for ZambaForCausalLM"),
    ({"hidden_mamba_act": "gelu"}, None, "hidden_mamba_act='gelu' is not supported for ZambaForCausalLM"),
    ({"n_mamba_heads": 1}, dict(tensor_parallel_size=2), "n_mamba_heads=1 does not split over "
     "tensor_parallel_size=2 for ZambaForCausalLM"),
    ({}, dict(pipeline_parallel_size=2), "pipeline_parallel_size=2 is not supported for ZambaForCausalLM")])
def test_zamba_refused(folders, changes, layout, field):
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    config = transformers.AutoConfig.from_pretrained(folders["zamba"])
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        get_bridge(config).check_layout(ParallelConfig(**(layout or {})))
