"""Granite 4.0 H (GraniteMoeHybridForCausalLM: Mamba2 and attention layers, experts beside a shared MLP, Granite's
multipliers), fp32 against transformers within 1e-4: 70-token rows (five chunks of the tiny model's 16-token SSD
scan) with the second left-padded by 9, logits, loss and transformers' balancing loss; a row packing documents
against each document alone; greedy generate without the cache, greedy and beam search with it (the Mamba2 layers'
conv and SSM states in the cache) over a left-padded batch, the refused static cache; a bit-exact export round trip;
the dense variant (``num_local_experts=0``, with rope). In a two-rank world: TP2 with sequence parallelism (logits,
loss, and every parameter's gradient exported through the bridge) and PP2 (logits, loss) on the tiny model's two
groups; on one group (the hub's ``mamba_n_groups=1``: B / C replicated on both TP ranks) TP2 with sequence
parallelism (logits, loss, every gradient, the round trip, cached greedy and beam search), EP2 and TP2 + SP + EP2
(ETP1) (logits, loss, balancing loss); CP2 with Qwen3.5's checks (packed documents and left padding across several
scan chunks per CP chunk: logits, loss, every gradient; an uncached generate with chunks shorter than the conv; the
refused cached one). The refused layouts are checked on the bridge alone (pure, before any collective)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4


def _ids(shape, seed=0):
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def _padded(ours, ref) -> dict:
    """Two rows of 70 tokens, the second left-padded by 9: the largest logit difference on real tokens, and the
    loss's and balancing loss's (when the model has experts)."""
    ids = _ids((2, 70)).to(ref.device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    moe = bool(ref.config.num_local_experts)
    if moe:
        kw["output_router_logits"] = True
    with torch.no_grad():
        got, want = ours(**kw), ref(**kw)
    out = {"logits": float((got.logits - want.logits).abs()[mask.bool()].max()), "loss": abs(got.loss - want.loss)}
    if moe:
        out["aux"] = abs(got.aux_loss.item() - want.aux_loss.item())
    return {k: float(v) for k, v in out.items()}


def _one_rank(folders: dict) -> dict:
    import tempfile

    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.round_trip import check_round_trip

    folder = folders["moe"]
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    from .test_qwen3_5 import packed_against_alone

    out = {"padded": _padded(ours, ref), "packed": packed_against_alone(ours, ref)}
    ids = _ids((2, 9), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
              output_scores=True)
    got, want = ours.generate(use_cache=False, **kw), ref.generate(**kw)
    out["generate"] = (torch.equal(got.sequences, want.sequences),
                       max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    out.update(_cached_generate(ours, ref))
    try:
        ours.generate(input_ids=ids, max_new_tokens=2, cache_implementation="static")
        out["static_refusal"] = None
    except ValueError as e:
        out["static_refusal"] = str(e)
    with tempfile.TemporaryDirectory() as saved:
        ours.save_pretrained(saved)
        check_round_trip(folder, saved)
        out["round_trip"] = True
    dense = lf.AutoModelForCausalLM.from_pretrained(folders["dense"], dtype=torch.float32)
    dense_ref = transformers.AutoModelForCausalLM.from_pretrained(folders["dense"], dtype=torch.float32).eval()
    out["dense"] = _padded(dense, dense_ref)
    return out


def _cached_generate(ours, ref) -> dict:
    """Greedy and 2-beam cached generate of a left-padded batch of two (the second prompt 4 tokens shorter):
    (sequences equal, largest score difference) against transformers' dynamic cache; the greedy call's cache layers
    and a Mamba2 layer's states (shapes, dtypes); the lengths each of our forwards ran (the prefill, then one token a
    step, padded for the layout)."""
    from tests._generation import step_lengths

    ids = _ids((2, 9), seed=3).to(ref.device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = {}
    for name, extra in {"greedy": {}, "beam": {"num_beams": 2}}.items():
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_scores=True, **extra)
        got, want = ours.generate(**kw), ref.generate(**kw)
        out[f"cached_{name}"] = (torch.equal(got.sequences, want.sequences),
                                 max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
        if name == "greedy":
            layers = got.cache.layers
            out["cache_layers"] = ([type(layer).__name__ for layer in layers],
                                   [(tuple(t.shape), t.dtype) for t in (layers[-1].conv_states[0],
                                                                        layers[-1].recurrent_states[0])])
    out["cached_lengths"] = step_lengths(ours, lambda: ours.generate(input_ids=ids, attention_mask=mask,
                                                                     max_new_tokens=3))
    return out


def _gradients(ours, ref, folder: str, tag: str) -> dict | None:
    """Every parameter's gradient after a backward over a left-padded batch, exported through the bridge, against
    transformers' (rank 0: relative to each tensor's largest; None elsewhere)."""
    import torch.distributed as dist

    from ._gradients import gradient_diffs, save_gradients

    ids = _ids((2, 40), seed=2).to(ref.device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ours(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    save_gradients(ours, f"{folder}-{tag}-grads")
    if dist.get_rank() != 0:
        return None
    ref.zero_grad()
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return gradient_diffs(f"{folder}-{tag}-grads", ref)


def _two_ranks(folders: dict) -> dict:
    """The tiny model's two groups: TP2 with sequence parallelism (logits, loss, every gradient), PP2 (logits, loss),
    CP2 (Qwen3.5's checks: ``test_qwen3_5._cp2_checks``). One group (``_one_group``)."""
    import transformers

    import loongforge_hf as lf

    from .test_qwen3_5 import _cp2_checks

    folder = folders["moe"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                   sequence_parallel=True)
    out = {"tp2": _padded(ours, ref), "grads": _gradients(ours, ref, folder, "tp2")}
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2)
    out["pp2"] = _padded(ours, ref)
    del ours
    ref.zero_grad()  # NOTE: rank 0's TP2 gradients (``_gradients``)
    out["cp2"] = _cp2_checks(folder, ref)
    return {**out, **_one_group(folders["g1"])}


def _one_group(folder: str) -> dict:
    """``mamba_n_groups=1`` (B / C replicated over TP): TP2 with sequence parallelism (logits, loss, the export
    round trip, cached greedy and beam search, every gradient), EP2 and TP2 + SP + EP2 with ETP1 (logits, loss)."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.round_trip import check_round_trip

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                   sequence_parallel=True)
    out = {"g1_tp2": _padded(ours, ref)}
    ours.save_pretrained(f"{folder}-tp2-saved")
    check_round_trip(folder, f"{folder}-tp2-saved")
    out["g1_round_trip"] = True
    out["g1_generate"] = _cached_generate(ours, ref)
    out["g1_grads"] = _gradients(ours, ref, folder, "g1-tp2")
    del ours
    for name, layout in (("g1_ep2", {}), ("g1_tp2_ep2", dict(tensor_parallel_size=2, sequence_parallel=True,
                                                             expert_tensor_parallel_size=1))):
        ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, expert_parallel_size=2, **layout)
        out[name] = _padded(ours, ref)
        del ours
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("granitemoehybrid")
    return {"moe": str(make_tiny_checkpoint(root / "moe", "granitemoehybrid")),
            "dense": str(make_tiny_checkpoint(root / "dense", "granitemoehybrid", num_local_experts=0,
                                              position_embedding_type="rope")),
            "g1": str(make_tiny_checkpoint(root / "g1", "granitemoehybrid", mamba_n_groups=1))}


@pytest.fixture(scope="module")
def one_rank(folders):
    return run_distributed(_one_rank, 1, folders, timeout=300)[0]


@pytest.fixture(scope="module")
def two_ranks(folders):
    return run_distributed(_two_ranks, 2, folders, timeout=300)


def _check_padded(res: dict) -> None:
    assert res["logits"] < TOL and res["loss"] < TOL and res.get("aux", 0.0) < TOL, res


def test_left_padded_rows_across_chunks(one_rank):
    _check_padded(one_rank["padded"])


def test_packed_documents_restart_the_scan(one_rank):
    """A row packing documents of 7, 20 and 11 tokens (position ids restarting at 0): each document's logits as
    transformers gives them for the document alone (the conv and the SSD state restart)."""
    assert max(one_rank["packed"]) < TOL, one_rank["packed"]


def test_generate_without_cache(one_rank):
    same, scores = one_rank["generate"]
    assert same and scores < TOL, one_rank["generate"]


def _check_cached_generate(res: dict, *, lengths: list, channels: int, heads: int) -> None:
    """Greedy and beam search with the cache: transformers' tokens and scores; after the prefill each forward runs the
    new token (``lengths``: padded to TP); one KV layer for the attention layer, then one state layer per Mamba2 layer
    (0, 1, 3): the last ``mamba_d_conv`` = 4 inputs of this rank's conv ``channels`` (its x, its groups' B / C), the
    fp32 SSM state ``[batch, heads, head_dim, d_state]`` of this rank's ``heads``."""
    for name in ("cached_greedy", "cached_beam"):
        same, scores = res[name]
        assert same and scores < TOL, (name, res[name])
    assert res["cached_lengths"] == lengths, res["cached_lengths"]
    kinds, states = res["cache_layers"]
    assert kinds == ["DynamicLayer"] + ["LinearAttentionLayer"] * 3, kinds
    assert states == [((2, channels, 4), torch.float32), ((2, heads, 16, 8), torch.float32)], states


def test_cached_generate_left_padded_batch(one_rank):
    _check_cached_generate(one_rank, lengths=[9, 1, 1], channels=128 + 2 * 2 * 8, heads=8)


def test_static_cache_refused(one_rank):
    refusal = one_rank["static_refusal"]
    assert refusal is not None and "cache_implementation='static' is not supported for " \
        "GraniteMoeHybridForCausalLM" in refusal and "keeps no Mamba2 conv / SSM state" in refusal, refusal


def test_export_round_trip(one_rank):
    assert one_rank["round_trip"]


def test_dense_variant(one_rank):
    """``num_local_experts=0``: the shared MLP alone as each layer's MLP; rotary attention."""
    _check_padded(one_rank["dense"])


@pytest.mark.parametrize("layout", ("tp2", "pp2", "g1_tp2", "g1_ep2", "g1_tp2_ep2"))
def test_two_rank_layouts(two_ranks, layout):
    """``g1_``: one group (the hub's), replicated on both TP ranks; EP2 and TP2 + SP + EP2 (ETP1)."""
    for res in two_ranks:
        _check_padded(res[layout])


@pytest.mark.parametrize("grads", ("grads", "g1_grads"))
def test_every_gradient_tp2_sequence_parallel(two_ranks, grads):
    """Two groups split over TP2, or one replicated on both ranks (the replicas' B / C rows of ``in_proj`` and the
    conv summed over the ranks, the gated norm's mean square over the group's channels on both)."""
    grads = two_ranks[0][grads]
    assert any(".mamba.in_proj" in n for n in grads) and any(".mamba.conv1d.bias" in n for n in grads), sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_one_group_tp2_round_trip_and_cached_generate(two_ranks):
    """One group at TP2 + SP: the bit-exact export (each rank read the group's B / C rows; exported once), cached
    greedy and beam search."""
    for res in two_ranks:
        assert res["g1_round_trip"]
        _check_cached_generate(res["g1_generate"], lengths=[10, 2, 2], channels=64 + 2 * 8, heads=4)


def test_context_parallel_padded_and_packed(two_ranks):
    """CP2 (four chunks of 38 tokens: three of the scan's 16-token chunks each) over a row packing documents of 38,
    35, 10, 12 and 57 tokens and a row left-padded by 9 (``test_qwen3_5._cp2_padded_and_packed``): transformers'
    logits and loss on both ranks' shares, every parameter's gradient (reduced over CP as megatron's DDP)."""
    for rank, res in enumerate(two_ranks):
        cp = res["cp2"]
        assert cp["logits"] < TOL and cp["loss"] < TOL, (rank, cp)
    grads = two_ranks[0]["cp2"]["grads"]
    mamba = [n for n in grads if ".mamba." in n]
    assert len(mamba) == 3 * 8 and any(".mamba.conv1d.bias" in n for n in mamba), sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_context_parallel_generate(two_ranks):
    """An uncached greedy generate under CP2 (a 6-token prompt padded to 8: chunks of 2, shorter than the conv's
    3-token history) gives transformers' tokens and scores; a cached one is refused on every rank."""
    for rank, res in enumerate(two_ranks):
        same, scores = res["cp2"]["generate"]
        assert same and scores < TOL, (rank, res["cp2"]["generate"])
        assert "under context parallelism generate with use_cache=False" in res["cp2"]["cached_refusal"], \
            (rank, res["cp2"]["cached_refusal"])


def _refused_config(folder: str, **changes):
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    for name, value in changes.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("changes, layout, field", [
    ({}, {"tensor_parallel_size": 16}, "mamba_n_heads=8 does not split"),
    ({"mamba_expand": 3, "mamba_n_heads": 12, "mamba_n_groups": 4}, {"tensor_parallel_size": 6},
     "mamba_n_groups=4 does not split over tensor_parallel_size=6")])
def test_refused_layouts(folders, changes, layout, field):
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    bridge = get_bridge(_refused_config(folders["moe"], **changes))
    with pytest.raises(UnsupportedConfigError, match=field):
        bridge.check_layout(ParallelConfig(**layout))
