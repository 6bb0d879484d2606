"""LFM2 (Lfm2ForCausalLM: short-conv and attention layers, conv biases, an adjusted MLP width) and LFM2-MoE
(Lfm2MoeForCausalLM: a dense first layer, sigmoid routing with an expert bias), fp32 against transformers within
1e-4. One rank: 70-token rows with the second left-padded by 9 (logits, loss; LFM2-MoE's router logits), a row
packing documents against each document alone, cached greedy and beam search over a left-padded batch (the conv
layers' states in the cache), the refused static cache, bit-exact export round trips. Two ranks: LFM2 at TP2 with
sequence parallelism (logits, loss, every parameter's gradient exported through the bridge, cached greedy) and CP2
with Qwen3.5's checks (packed documents and left padding across the chunks: logits, loss, every gradient; an
uncached generate with chunks shorter than the conv; the refused cached one); LFM2-MoE at TP2 + SP + EP2 (ETP1). The
refused layout and routing are checked on the bridge alone (pure, before any collective)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4


def _ids(shape, seed=0):
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def _models(folder: str, **layout):
    import transformers

    import loongforge_hf as lf

    return (lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


def _padded(ours, ref) -> dict:
    """Two rows of 70 tokens, the second left-padded by 9: the largest logit difference on real tokens, the loss's;
    LFM2-MoE's router logits (every MoE layer, real tokens)."""
    ids = _ids((2, 70))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    moe = ref.config.model_type == "lfm2_moe"
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    with torch.no_grad():
        got, want = ours(**kw, output_router_logits=moe), ref(**kw, output_router_logits=moe)
    out = {"logits": float((got.logits - want.logits).abs()[mask.bool()].max()), "loss": abs(got.loss - want.loss)}
    if moe:
        real = mask.flatten().bool()
        out["router"] = max(float((a.reshape(-1, a.shape[-1]) - b.reshape(-1, b.shape[-1]))[real].abs().max())
                            for a, b in zip(got.router_logits, want.router_logits, strict=True))
    return {k: float(v) for k, v in out.items()}


def _cached_generate(ours, ref, *, beams: bool) -> dict:
    """Greedy (and 2-beam) cached generate of a left-padded batch of two (the second prompt 4 tokens shorter):
    (sequences equal, largest score difference) against transformers' dynamic cache; the greedy call's cache layers
    and the last one's conv state (shape, dtype)."""
    ids = _ids((2, 9), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = {}
    for name, extra in ({"greedy": {}, "beam": {"num_beams": 2}} if beams else {"greedy": {}}).items():
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_scores=True, **extra)
        got, want = ours.generate(**kw), ref.generate(**kw)
        out[name] = (torch.equal(got.sequences, want.sequences),
                     max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
        if name == "greedy":
            layers = got.cache.layers
            state = layers[-1].conv_states[0]
            out["cache_layers"] = ([type(layer).__name__ for layer in layers], (tuple(state.shape), state.dtype))
    return out


def _one_rank(folders: dict) -> dict:
    import tempfile

    from loongforge_hf.testing.round_trip import check_round_trip

    from .test_qwen3_5 import packed_against_alone

    out = {}
    for arch, folder in folders.items():
        ours, ref = _models(folder)
        res = {"padded": _padded(ours, ref), "packed": packed_against_alone(ours, ref),
               **_cached_generate(ours, ref, beams=arch == "lfm2")}
        with tempfile.TemporaryDirectory() as saved:
            ours.save_pretrained(saved)
            check_round_trip(folder, saved)
            res["round_trip"] = True
        out[arch] = res
    try:
        ours.generate(input_ids=_ids((1, 4)), max_new_tokens=2, cache_implementation="static")
        out["static_refusal"] = None
    except ValueError as e:
        out["static_refusal"] = str(e)
    return out


def _two_ranks(folders: dict) -> dict:
    """LFM2 at TP2 + SP (logits, loss, every gradient, cached greedy), then CP2 (``test_qwen3_5._cp2_checks``);
    LFM2-MoE at TP2 + SP + EP2 (ETP1)."""
    from .test_granitemoehybrid import _gradients
    from .test_qwen3_5 import _cp2_checks

    folder = folders["lfm2"]
    ours, ref = _models(folder, tensor_parallel_size=2, sequence_parallel=True)
    out = {"tp2": _padded(ours, ref), "tp2_generate": _cached_generate(ours, ref, beams=False),
           "grads": _gradients(ours, ref, folder, "tp2")}
    del ours
    out["cp2"] = _cp2_checks(folder, ref)
    ours, ref = _models(folders["lfm2_moe"], tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2,
                        expert_tensor_parallel_size=1)
    out["moe_tp2_ep2"] = _padded(ours, ref)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfm2")
    return {arch: str(make_tiny_checkpoint(root / arch, arch)) for arch in ("lfm2", "lfm2_moe")}


@pytest.fixture(scope="module")
def one_rank(folders):
    return run_distributed(_one_rank, 1, folders, timeout=300)[0]


@pytest.fixture(scope="module")
def two_ranks(folders):
    return run_distributed(_two_ranks, 2, folders, timeout=300)


def _check_padded(res: dict) -> None:
    assert max(res.values()) < TOL, res


@pytest.mark.parametrize("arch", ("lfm2", "lfm2_moe"))
def test_left_padded_rows(one_rank, arch):
    """The padded tokens' conv inputs are ``in_proj``'s bias products (LFM2's conv bias), as transformers zeroes
    their hidden states."""
    _check_padded(one_rank[arch]["padded"])


@pytest.mark.parametrize("arch", ("lfm2", "lfm2_moe"))
def test_packed_documents_restart_the_conv(one_rank, arch):
    """A row packing documents of 7, 20 and 11 tokens (position ids restarting at 0): each document's logits as
    transformers gives them for the document alone."""
    assert max(one_rank[arch]["packed"]) < TOL, one_rank[arch]["packed"]


@pytest.mark.parametrize("arch, name", (("lfm2", "greedy"), ("lfm2", "beam"), ("lfm2_moe", "greedy")))
def test_cached_generate_left_padded_batch(one_rank, arch, name):
    """transformers' tokens and scores; one KV layer for the attention layer, then one state layer per conv layer
    (0, 1, 3) holding the last ``conv_L_cache`` = 3 conv inputs of the 64 channels."""
    same, scores = one_rank[arch][name]
    assert same and scores < TOL, one_rank[arch][name]
    kinds, state = one_rank[arch]["cache_layers"]
    assert kinds == ["DynamicLayer"] + ["LinearAttentionLayer"] * 3 and state == ((2, 64, 3), torch.float32), \
        one_rank[arch]["cache_layers"]


def test_static_cache_refused(one_rank):
    refusal = one_rank["static_refusal"]
    assert refusal is not None and "cache_implementation='static' is not supported for Lfm2MoeForCausalLM" in refusal \
        and "keeps no conv state" in refusal, refusal


@pytest.mark.parametrize("arch", ("lfm2", "lfm2_moe"))
def test_export_round_trip(one_rank, arch):
    assert one_rank[arch]["round_trip"]


@pytest.mark.parametrize("layout", ("tp2", "moe_tp2_ep2"))
def test_two_rank_layouts(two_ranks, layout):
    for res in two_ranks:
        _check_padded(res[layout])


def test_every_gradient_tp2_sequence_parallel(two_ranks):
    """Every parameter (the conv's channels split over TP, ``in_proj``'s bias blocks, ``out_proj``'s bias whole)."""
    grads = two_ranks[0]["grads"]
    assert any(".conv.in_proj.bias" in n for n in grads) and any(".conv.conv.weight" in n for n in grads), grads
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_tp2_cached_generate(two_ranks):
    """Each rank its 32 channels' conv states; a one-token step padded to two, the padding kept out of the state."""
    for res in two_ranks:
        same, scores = res["tp2_generate"]["greedy"]
        assert same and scores < TOL, res["tp2_generate"]
        assert res["tp2_generate"]["cache_layers"][1] == ((2, 32, 3), torch.float32), res["tp2_generate"]


def test_context_parallel_padded_and_packed(two_ranks):
    """CP2 (four chunks of 38 tokens) over a row packing documents of 38, 35, 10, 12 and 57 tokens and a row
    left-padded by 9 (``test_qwen3_5._cp2_padded_and_packed``): transformers' logits and loss on both ranks' shares,
    every parameter's gradient (reduced over CP as megatron's DDP)."""
    for rank, res in enumerate(two_ranks):
        cp = res["cp2"]
        assert cp["logits"] < TOL and cp["loss"] < TOL, (rank, cp)
    grads = two_ranks[0]["cp2"]["grads"]
    assert len([n for n in grads if ".conv." in n]) == 3 * 6, sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_context_parallel_generate(two_ranks):
    """An uncached greedy generate under CP2 (a 6-token prompt padded to 8: chunks of 2, the conv's history crossing
    two of them) gives transformers' tokens and scores; a cached one is refused on every rank."""
    for rank, res in enumerate(two_ranks):
        same, scores = res["cp2"]["generate"]
        assert same and scores < TOL, (rank, res["cp2"]["generate"])
        assert "under context parallelism generate with use_cache=False" in res["cp2"]["cached_refusal"], \
            (rank, res["cp2"]["cached_refusal"])


def _config(folder: str, **changes):
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def test_refused_layout_and_routing(folders):
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    with pytest.raises(UnsupportedConfigError, match="hidden_size=64 does not split over tensor_parallel_size=3"):
        get_bridge(_config(folders["lfm2"])).check_layout(ParallelConfig(tensor_parallel_size=3))
    with pytest.raises(UnsupportedConfigError, match="norm_topk_prob=False with num_experts_per_tok=2"):
        get_bridge(_config(folders["lfm2_moe"], norm_topk_prob=False))
    with pytest.raises(UnsupportedConfigError, match=r"layer_types \['conv', 'mamba'"):
        get_bridge(_config(folders["lfm2"], layer_types=["conv", "mamba", "full_attention", "conv"]))
