"""OLMo Hybrid (bridges/olmo_hybrid.py): Gated DeltaNet layers with separate projections, the hub's three conv tensors
and doubled beta, and OLMo 3 style full-attention layers (post norms, q / k norms over all heads, no rotary embedding
as released; plain rope when the config has a theta), against transformers in fp32 within 1e-4.

One one-rank world: 150 tokens (three chunks of the delta rule) with a left-padded row, logits and loss, without and
with rope; a row of packed documents against each alone; cached greedy generate of a left-padded batch (the
full layer's keys, the Gated DeltaNets' states); the static cache refused; a bit-exact export. One two-rank world:
TP2 + SP and PP2 (logits, loss, bit-exact exports), CP2 over packed documents and left padding (logits, loss and
every tensor's gradient, exported through the bridge), LoRA with "all-linear" at TP2 + SP against PEFT (the six
in-projections each in its slot of megatron's ``in_proj``). The refusals run without a world."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.round_trip import check_round_trip

TOL = 1e-4
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}, "pp2": {"pipeline_parallel_size": 2}}


def _padded(folder: str) -> tuple:
    """Ours and transformers' models of ``folder``, and their largest logit (real tokens) and loss differences over
    150 tokens, the second row left-padded by 9."""
    import transformers

    import loongforge_hf as lf

    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(4, 203, (2, 150), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    with torch.no_grad():
        got, want = ours(**kw), ref(**kw)
    return ours, ref, (float((got.logits - want.logits).abs()[mask.bool()].max()), abs(got.loss.item()
                                                                                       - want.loss.item()))


def _one_rank(folders: dict) -> dict:
    from .test_qwen3_5 import _cached_generate, packed_against_alone

    out = {"rope": _padded(folders["rope"])[2]}
    ours, ref, out["nope"] = _padded(folders["nope"])
    out["positions"] = ours.bridge.position_embedding_type
    out["packed"] = packed_against_alone(ours, ref)
    out.update(_cached_generate(ours, ref, beams=False))
    try:
        ours.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="static")
        out["static_refusal"] = None
    except ValueError as e:
        out["static_refusal"] = str(e)
    ours.save_pretrained(f"{folders['nope']}-out", max_shard_size="50KB")
    return out


def _two_ranks(folder: str) -> dict:
    import transformers

    import loongforge_hf as lf

    from ._parity import load_compare_export
    from .test_qwen3_5 import _cp2_padded_and_packed

    out = {name: load_compare_export(folder, layout, f"{folder}-{name}", padded=True)
           for name, layout in LAYOUTS.items()}
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out["cp2"] = _cp2_padded_and_packed(ours, ref, folder)
    del ours, ref
    from ..integrations._lora_hybrids import ALL_LINEAR, hybrid_lora_checks

    out["lora"] = hybrid_lora_checks(folder, f"{folder}-lora-tp2", dict(tensor_parallel_size=2, sequence_parallel=True),
                                     ALL_LINEAR)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmo_hybrid")
    return {"nope": str(make_tiny_checkpoint(root / "nope", "olmo_hybrid")),
            "rope": str(make_tiny_checkpoint(root / "rope", "olmo_hybrid", rope_parameters=ROPE))}


@pytest.fixture(scope="module")
def one_rank(folders):
    return run_distributed(_one_rank, 1, folders, timeout=300)[0]


@pytest.fixture(scope="module")
def two_ranks(folders):
    return run_distributed(_two_ranks, 2, folders["nope"], timeout=300)


@pytest.mark.parametrize("case", ("nope", "rope"))
def test_left_padded_long_sequences(one_rank, case):
    """Logits and loss over three chunks of the delta rule, a row left-padded; the released checkpoints' NoPE and
    rope on the full layer."""
    assert max(one_rank[case]) < TOL, one_rank[case]
    assert one_rank["positions"] == "none"


def test_packed_documents_restart_the_recurrence(one_rank):
    assert max(one_rank["packed"]) < TOL, one_rank["packed"]


def test_cached_generate_left_padded_batch(one_rank):
    """Greedy with the cache: transformers' tokens and scores; one KV layer for the full layer, then one state layer
    per Gated DeltaNet (the conv's last 3 inputs of 2 * 16 + 48 channels; the fp32 state of 4 value heads)."""
    same, scores = one_rank["cached_greedy"]
    assert same and scores < TOL, one_rank["cached_greedy"]
    assert one_rank["cached_lengths"] == [9, 1, 1, 1], one_rank["cached_lengths"]
    kinds, states = one_rank["cache_layers"]
    assert kinds == ["DynamicLayer"] + ["LinearAttentionLayer"] * 3, kinds
    assert states == [((2, 80, 3), torch.float32), ((2, 4, 8, 12), torch.float32)], states
    assert "cache_implementation='static' is not supported for OlmoHybridForCausalLM" in one_rank["static_refusal"]


def test_export_round_trip(one_rank, folders):
    """The hub's names (attention_layer_norm, feedforward_layer_norm, q / k / v_conv1d) back bit for bit."""
    check_round_trip(folders["nope"], f"{folders['nope']}-out")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_and_pipeline_parallel(two_ranks, folders, layout):
    for r in two_ranks:
        res = r[layout]
        assert res["logit_diff"] < TOL and res["loss_diff"] < TOL, (layout, res)
        assert res["grads_ok"] in (None, True), res
    check_round_trip(folders["nope"], f"{folders['nope']}-{layout}")


def test_lora_all_linear_matches_peft(two_ranks):
    """LoRA with ``"all-linear"`` at TP2 + SP against PEFT (``integrations/_lora_hybrids.py``): ``q`` / ``k`` / ``v`` /
    ``g`` / ``b`` / ``a_proj`` of the linear layers in their slots of megatron's ``in_proj``, the full layer's q / k /
    v / o, the MLPs (37 modules): logits, loss, every adapter gradient, the adapter folder in PEFT and the merged
    export in transformers."""
    from ..integrations._lora_hybrids import check_matches_peft

    check_matches_peft([r["lora"] for r in two_ranks], targets=37)


def test_context_parallel_gradients(two_ranks):
    """CP2 over packed documents and a left-padded row: logits, loss, and every tensor's gradient (the Gated
    DeltaNets' separate projections and conv tensors, the post norms, the full-width q / k norms) on rank 0."""
    for rank, res in enumerate(two_ranks):
        assert res["cp2"]["logits"] < TOL and res["cp2"]["loss"] < TOL, (rank, res["cp2"])
    grads = two_ranks[0]["cp2"]["grads"]
    assert len(grads) == 62 and any(".linear_attn.g_proj." in n for n in grads), sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


def test_refusals():
    """What the bridge cannot run exactly fails by name when the bridge is made (before any collective)."""
    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    arch = "OlmoHybridForCausalLM"
    for field, value, match in (
            ("layer_types", ["sliding_attention"] + ["linear_attention"] * 3,
             rf"layer_types \['sliding_attention'\] are not supported for {arch}"),
            ("linear_num_value_heads", 3, r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
            ("hidden_act", "gelu", rf"hidden_act='gelu' is not supported for {arch}"),
            ("attention_bias", True, rf"attention_bias=True is not supported for {arch}"),
            ("rope_parameters", {**ROPE, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
             r"rope_type='yarn' is not implemented"),
            ("rope_parameters", {**ROPE, "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported")):
        with pytest.raises(UnsupportedConfigError, match=match):
            get_bridge(_config("olmo_hybrid", **{field: value}))
    with pytest.raises(UnsupportedConfigError, match=r"linear_num_key_heads=2 does not split over "
                                                     r"tensor_parallel_size=4"):
        get_bridge(_config("olmo_hybrid")).check_layout(ParallelConfig(tensor_parallel_size=4))
    roped = get_bridge(_config("olmo_hybrid", rope_parameters=ROPE))
    assert getattr(roped, "position_embedding_type", "rope") == "rope"
