"""LFM2 (Lfm2ForCausalLM: short-conv and attention layers, conv biases, an adjusted MLP width) and LFM2-MoE
(Lfm2MoeForCausalLM: a dense first layer, sigmoid routing with an expert bias), fp32 against transformers within
1e-4. One rank: 70-token rows with the second left-padded by 9 (logits, loss; LFM2-MoE's router logits), a row
packing documents against each document alone, cached greedy and beam search over a left-padded batch (the conv
layers' states in the cache), the refused static cache, bit-exact export round trips; LFM2-MoE's routing bit for bit
(the router's logits, probabilities, map and gradient). Two ranks: LFM2 at TP2 with sequence parallelism (logits,
loss, every parameter's gradient exported through the bridge, cached greedy), CP2 with Qwen3.5's checks (packed
documents and left padding across the chunks: logits, loss, every gradient; an uncached generate with chunks shorter
than the conv; the refused cached one) and PP2, LoRA on the conv layers at TP2 + SP against PEFT; LFM2-MoE at TP2 +
SP + EP2 (ETP1) and CP2. The refused layout and layer types are checked on the bridge alone (pure, before any
collective)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
# NOTE: the conv layers' in_proj (B, C, x row sections, each split over TP) and out_proj, and the attention layer's
# out_proj, B random so that the adapters change the logits
LORA = dict(r=4, lora_alpha=8, target_modules=["in_proj", "out_proj"], init_lora_weights=False)


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


def _router_checks(ours, ref) -> dict:
    """LFM2-MoE's router (layer 1) bit for bit: its logits on random hidden states against transformers' gate's; then
    ``sigmoid_route`` (in the router's ``route`` slot) against transformers' ``Lfm2MoeTopKRouter`` on the same logits
    (through a gate whose weight picks the first 4 hidden features: the logits exactly), fp32 and bf16, of typical
    size and around -12 (scores ~1e-5, where 1e-6 in the denominator moves the weights by ~5 %): the probabilities,
    the map and the logits' gradient; with ``norm_topk_prob`` off and with one expert chosen; and how far megatron's
    own function (1e-20 in the denominator) is from transformers' there. A deep copy of the model routes with its own
    router's bias."""
    import copy

    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from loongforge_hf.bridges.lfm2_moe import sigmoid_route

    router, gate = ours.chunks[0].decoder.layers[1].mlp.router, ref.model.layers[1].feed_forward.gate
    bias = ref.model.layers[1].feed_forward.expert_bias
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = {"logits": torch.equal(router.gating(x[:, None]).view(24, 4), gate(x, bias)[0])}
    twin = copy.deepcopy(ours).chunks[0].decoder.layers[1].mlp.router  # NOTE: routes with its own bias
    out["copy"] = twin.route.__self__ is twin and twin.expert_bias is not router.expert_bias
    c, tf_router = ref.config, type(gate)

    def hf(logits, config):
        """transformers' router on ``logits`` (dense probabilities, map) and the logits' gradient."""
        module = tf_router(config).to(logits.dtype)
        with torch.no_grad():
            module.weight.copy_(torch.eye(4, 64))
        x = torch.nn.functional.pad(logits, (0, 60)).requires_grad_()
        _, weights, chosen = module(x, bias)
        probs = torch.zeros_like(logits).scatter(1, chosen, weights)
        probs.backward(torch.arange(probs.numel(), dtype=probs.dtype).view_as(probs))
        return probs.detach(), torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True), x.grad[:, :4]

    def ours_(logits, route):
        logits = logits.clone().requires_grad_()
        probs, routing_map = route(logits)
        probs.backward(torch.arange(probs.numel(), dtype=probs.dtype).view_as(probs))
        return probs.detach(), routing_map, logits.grad

    same, megatron_gap = {}, 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for shift in (0.0, -12.0):
            logits = (torch.randn(64, 4, generator=torch.Generator().manual_seed(6)) * 2 + shift).to(dtype)
            want = hf(logits, c)
            got = ours_(logits, lambda t: router.route(t, False))
            same[f"{dtype}/{shift}"] = all(torch.equal(a, b) for a, b in zip(got, want))
            megatron = topk_routing_with_score_function(logits, 2, score_function="sigmoid", expert_bias=bias,
                                                        scaling_factor=c.routed_scaling_factor)[0]
            gap = (megatron - want[0]).abs() / want[0].abs().max()
            megatron_gap = max(megatron_gap, float(gap.max()))
            for name, changes in (("unnormalised", dict(norm_topk_prob=False)),
                                  ("top1", dict(num_experts_per_tok=1))):
                config = type(c).from_dict({**c.to_dict(), **changes})
                want = hf(logits, config)
                got = ours_(logits, lambda t: sigmoid_route(t, topk=config.num_experts_per_tok, bias=bias,
                                                            normalize=config.norm_topk_prob,
                                                            scale=config.routed_scaling_factor))
                same[f"{dtype}/{shift}/{name}"] = all(torch.equal(a, b) for a, b in zip(got, want))
    return {**out, "same": same, "megatron_gap": megatron_gap}


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
    out["router"] = _router_checks(ours, ref)
    try:
        ours.generate(input_ids=_ids((1, 4)), max_new_tokens=2, cache_implementation="static")
        out["static_refusal"] = None
    except ValueError as e:
        out["static_refusal"] = str(e)
    return out


def _two_ranks(folders: dict) -> dict:
    """LFM2 at TP2 + SP (logits, loss, every gradient, cached greedy), then CP2 (``test_qwen3_5._cp2_checks``), PP2
    (logits, loss), LoRA at TP2 + SP (``LORA``); LFM2-MoE at TP2 + SP + EP2 (ETP1) and CP2 (logits, loss, router
    logits)."""
    import loongforge_hf as lf

    from ..integrations._lora_hybrids import hybrid_lora_checks
    from .test_granitemoehybrid import _gradients
    from .test_qwen3_5 import _cp2_checks

    folder = folders["lfm2"]
    ours, ref = _models(folder, tensor_parallel_size=2, sequence_parallel=True)
    out = {"tp2": _padded(ours, ref), "tp2_generate": _cached_generate(ours, ref, beams=False),
           "grads": _gradients(ours, ref, folder, "tp2")}
    del ours
    out["cp2"] = _cp2_checks(folder, ref)
    out["pp2"] = _padded(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2),
                         ref)
    out["lora"] = hybrid_lora_checks(folder, f"{folder}-lora", dict(tensor_parallel_size=2, sequence_parallel=True),
                                     LORA)
    ours, ref = _models(folders["lfm2_moe"], tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2,
                        expert_tensor_parallel_size=1)
    out["moe_tp2_ep2"] = _padded(ours, ref)
    del ours
    out["moe_cp2"] = _padded(lf.AutoModelForCausalLM.from_pretrained(folders["lfm2_moe"], dtype=torch.float32,
                                                                     context_parallel_size=2), ref)
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


@pytest.mark.parametrize("layout", ("tp2", "pp2", "moe_tp2_ep2", "moe_cp2"))
def test_two_rank_layouts(two_ranks, layout):
    for res in two_ranks:
        _check_padded(res[layout])


def test_every_gradient_tp2_sequence_parallel(two_ranks):
    """Every parameter (the conv's channels split over TP, ``in_proj``'s bias blocks, ``out_proj``'s bias whole)."""
    grads = two_ranks[0]["grads"]
    assert any(".conv.in_proj.bias" in n for n in grads) and any(".conv.conv.weight" in n for n in grads), grads
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_lora_on_conv_layers_tp2_sequence_parallel(two_ranks):
    """LoRA on the conv layers' ``in_proj`` / ``out_proj`` (and the attention's ``out_proj``) at TP2 + SP against
    PEFT (``_lora_hybrids``): logits, loss, every adapter's A and B gradient at HF shape; the adapter folder in PEFT
    and the merged export in transformers give our logits."""
    for res in two_ranks:
        lora = res["lora"]
        assert lora["logits"] < TOL and lora["loss"] < 1e-5 and lora["unchanged_after_merged_export"], lora
        assert len(lora["targets"]) == 7 and len(lora["grads"]) == 14, lora["targets"]
        worst = max(lora["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst
    rank0 = two_ranks[0]["lora"]
    assert rank0["adapter_logits_diff"] < TOL and rank0["merged_logits_diff"] < TOL, rank0


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


def test_lfm2_moe_routing_is_transformers_bit_for_bit(one_rank):
    """The router's logits, and ``sigmoid_route``'s probabilities, map and logits' gradient, equal transformers' (fp32,
    bf16; scores of typical size and ~1e-5; ``norm_topk_prob`` on and off; top 2 and top 1), where megatron's own
    function is more than 1 % off at the small scores."""
    res = one_rank["router"]
    assert res["logits"] and res["copy"] and all(res["same"].values()), res
    assert res["megatron_gap"] > 1e-2, res


def _config(folder: str, **changes):
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def test_refused_layout_layer_types_and_megatron_fields(folders):
    """Pure refusals: the channels over TP, an unknown layer type, and megatron fields that LFM2-MoE's own routing
    (``sigmoid_route``) would not apply."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.builder import check_megatron_config
    from loongforge_hf.parallel import ParallelConfig

    with pytest.raises(UnsupportedConfigError, match="hidden_size=64 does not split over tensor_parallel_size=3"):
        get_bridge(_config(folders["lfm2"])).check_layout(ParallelConfig(tensor_parallel_size=3))
    with pytest.raises(UnsupportedConfigError, match=r"layer_types \['conv', 'mamba'"):
        get_bridge(_config(folders["lfm2"], layer_types=["conv", "mamba", "full_attention", "conv"]))
    with pytest.raises(ValueError, match="moe_router_topk_scaling_factor: Lfm2MoeForCausalLM routes with its own"):
        check_megatron_config(get_bridge(_config(folders["lfm2_moe"])), {"moe_router_topk_scaling_factor": 2.0})
