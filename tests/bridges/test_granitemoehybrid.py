"""Granite 4.0 H (GraniteMoeHybridForCausalLM: Mamba2 and attention layers, experts beside a shared MLP, Granite's
multipliers), fp32 against transformers within 1e-4: 70-token rows (five chunks of the tiny model's 16-token SSD
scan) with the second left-padded by 9, logits, loss and transformers' balancing loss; a row packing documents
against each document alone; greedy generate without the cache over a left-padded batch, the refused cached one; a
bit-exact export round trip; the dense variant (``num_local_experts=0``, with rope). In a two-rank world: TP2 with
sequence parallelism (logits, loss, and every parameter's gradient exported through the bridge) and PP2 (logits,
loss). The refused layouts are checked on the bridge alone (pure, before any collective)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-4
LENGTHS = (7, 20, 11)  # NOTE: the packed row's documents


def _ids(shape, seed=0):
    return torch.randint(4, 203, shape, generator=torch.Generator().manual_seed(seed))


def _padded(ours, ref) -> dict:
    """Two rows of 70 tokens, the second left-padded by 9: the largest logit difference on real tokens, and the
    loss's and balancing loss's (when the model has experts)."""
    ids = _ids((2, 70))
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
    out = {"padded": _padded(ours, ref)}
    ids = _ids((1, sum(LENGTHS)), seed=1)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=positions).logits[0]
        start, out["packed"] = 0, []
        for n in LENGTHS:
            alone = ref(input_ids=ids[:, start:start + n]).logits[0]
            out["packed"].append(float((packed[start:start + n] - alone).abs().max()))
            start += n
    ids = _ids((2, 9), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
              output_scores=True)
    got, want = ours.generate(use_cache=False, **kw), ref.generate(**kw)
    out["generate"] = (torch.equal(got.sequences, want.sequences),
                       max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)))
    try:
        ours.generate(input_ids=ids, max_new_tokens=2)
        out["cached_refusal"] = None
    except ValueError as e:
        out["cached_refusal"] = str(e)
    with tempfile.TemporaryDirectory() as saved:
        ours.save_pretrained(saved)
        check_round_trip(folder, saved)
        out["round_trip"] = True
    dense = lf.AutoModelForCausalLM.from_pretrained(folders["dense"], dtype=torch.float32)
    dense_ref = transformers.AutoModelForCausalLM.from_pretrained(folders["dense"], dtype=torch.float32).eval()
    out["dense"] = _padded(dense, dense_ref)
    return out


def _two_ranks(folder: str) -> dict:
    """TP2 with sequence parallelism: logits, loss, every parameter's gradient (rank 0: relative to each tensor's
    largest); then PP2: logits and loss."""
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf

    from ._gradients import _reduce_as_megatron

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                   sequence_parallel=True)
    out = {"tp2": _padded(ours, ref)}
    ids = _ids((2, 40), seed=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ours(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    _reduce_as_megatron(ours)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(p.grad)
    ours.save_pretrained(f"{folder}-tp2-grads")
    if dist.get_rank() == 0:
        ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        exported = dict(transformers.AutoModelForCausalLM.from_pretrained(f"{folder}-tp2-grads", dtype=torch.float32)
                        .named_parameters())
        out["grads"] = {n: float((exported[n].detach() - p.grad).abs().max()) / (float(p.grad.abs().max()) or 1.0)
                        for n, p in ref.named_parameters()}
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2)
    out["pp2"] = _padded(ours, ref)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("granitemoehybrid")
    return {"moe": str(make_tiny_checkpoint(root / "moe", "granitemoehybrid")),
            "dense": str(make_tiny_checkpoint(root / "dense", "granitemoehybrid", num_local_experts=0,
                                              position_embedding_type="rope"))}


@pytest.fixture(scope="module")
def one_rank(folders):
    return run_distributed(_one_rank, 1, folders, timeout=300)[0]


@pytest.fixture(scope="module")
def two_ranks(folders):
    return run_distributed(_two_ranks, 2, folders["moe"], timeout=300)


def _check_padded(res: dict) -> None:
    assert res["logits"] < TOL and res["loss"] < TOL and res.get("aux", 0.0) < TOL, res


def test_left_padded_rows_across_chunks(one_rank):
    _check_padded(one_rank["padded"])


def test_packed_documents_restart_the_scan(one_rank):
    """A row packing documents of 7, 20 and 11 tokens (position ids restarting at 0): each document's logits as
    transformers gives them for the document alone (the conv and the SSD state restart)."""
    assert max(one_rank["packed"]) < TOL, one_rank["packed"]


def test_generate_without_cache_and_cached_refused(one_rank):
    same, scores = one_rank["generate"]
    assert same and scores < TOL, one_rank["generate"]
    assert "holds no Mamba2 conv / SSM state; generate with use_cache=False" in one_rank["cached_refusal"], \
        one_rank["cached_refusal"]


def test_export_round_trip(one_rank):
    assert one_rank["round_trip"]


def test_dense_variant(one_rank):
    """``num_local_experts=0``: the shared MLP alone as each layer's MLP; rotary attention."""
    _check_padded(one_rank["dense"])


@pytest.mark.parametrize("layout", ("tp2", "pp2"))
def test_two_rank_layouts(two_ranks, layout):
    for res in two_ranks:
        _check_padded(res[layout])


def test_every_gradient_tp2_sequence_parallel(two_ranks):
    grads = two_ranks[0]["grads"]
    assert any(".mamba.in_proj" in n for n in grads) and any(".mamba.conv1d.bias" in n for n in grads), sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])


@pytest.mark.parametrize("layout, field", [({"tensor_parallel_size": 4}, "mamba_n_groups=2 does not split"),
                                           ({"context_parallel_size": 2}, "context_parallel_size=2 is not supported")])
def test_refused_layouts(folders, layout, field):
    import transformers

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.parallel import ParallelConfig

    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folders["moe"]))
    with pytest.raises(UnsupportedConfigError, match=field):
        bridge.check_layout(ParallelConfig(**layout))
