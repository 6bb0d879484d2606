"""Tensor parallelism beyond the number of KV heads: each HF key / value head replicated on ``tp / kv`` ranks
(``parallel/kv_replicas.py``).

In one two-rank world at TP2 with sequence parallelism, one KV head each: a Llama (separate q / k / v), Phi-3 (packed
``qkv_proj``) and GPTBigCode (StarCoder's multi-query ``c_attn`` with biases), fp32 against transformers: logits within
1e-4; the HF -> megatron -> HF round trip bit-exact; every tensor's gradient after a backward (reduced as the engine's
finalize reduces it) within 1e-4 of its largest; for the Llama (distributed optimizer) and GPTBigCode (model-precision
optimizer) two engine steps with clipping active on each against transformers stepped by hand (same norms within 1e-5,
weights within 1e-5, the replicas bit-equal after the steps, the export loaded by transformers); LoRA on ``q_proj`` /
``k_proj`` / ``v_proj`` / ``o_proj`` against PEFT's logits, adapter gradients and adapter folder (DoRA's logits and
gradients, its magnitudes too), on Phi-3's packed ``qkv_proj`` refused. Without the gradient sum the K / V rows get half
their gradient (weights 4e-2 off after two steps); without the norm's correction the K / V rows count twice (norms 12%
off, weights 2e-3). Falcon-7B's and StarCoder's layouts also run in the shared suites' TP layouts
(tests/bridges/test_dense_parity.py, test_gradients.py). Pure checks: the q / k / v mappings' shards and exports at 2 KV
heads over 4 ranks (GQA), and the layouts refused."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.round_trip import check_round_trip

TOL = 1e-4
# name: (tiny architecture, overrides, the engine's optimizer_precision or None)
CASES = {"llama": ("llama", {"num_key_value_heads": 1}, "fp32"),
         "phi3": ("phi3", {"num_key_value_heads": 1}, None),
         "gpt_bigcode": ("gpt_bigcode", {}, "model")}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.parallel._kv_replicas import kv_replica_checks

    root = tmp_path_factory.mktemp("kv-replicas")
    folders = {name: str(make_tiny_checkpoint(root / name, arch, **kw)) for name, (arch, kw, _) in CASES.items()}
    cases = [(name, folders[name], precision) for name, (_, _, precision) in CASES.items()]
    results = run_distributed(kv_replica_checks, 2, cases, str(root), timeout=600)
    return root, folders, results


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_round_trip(world, name):
    root, folders, results = world
    got = results[0][name]
    assert got["marked"] > 0 and got["logits"] < TOL and got["loss"] < TOL, got
    check_round_trip(folders[name], root / f"{name}-saved")


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_transformers(world, name):
    _, _, results = world
    diffs = results[0][name]["grads"]
    kv = [n for n in diffs if any(k in n for k in ("k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn"))]
    assert kv and max(diffs.values()) < TOL, {n: d for n, d in diffs.items() if d >= TOL}


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2]])
def test_engine_steps_match_transformers(world, name):
    _, _, results = world
    got = results[0][name]
    assert all(n > 0.05 for n in got["hf_norms"]), got["hf_norms"]  # NOTE: every step clips
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(got["hf_norms"]), rtol=1e-5, atol=0)
    assert max(got["trained"].values()) < 1e-5, {n: d for n, d in got["trained"].items() if d >= 1e-5}
    assert all(r[name]["replicas_equal"] for r in results)
    assert results[0][name]["norms"] == results[1][name]["norms"]


@pytest.mark.parametrize("case", ["llama", "phi3", "gpt_bigcode"])
def test_lora_on_query_key_value_rows_matches_peft(world, case):
    """Adapters on the replicated KV head: k_proj / v_proj's B (Llama), or the K / V rows of a packed q / k / v
    linear's B (Phi-3's qkv_proj, GPTBigCode's c_attn), summed over the replicas as the weight's K / V rows (without
    that sum their gradients are one replica's share: 1.2 relative to PEFT's); DoRA's magnitudes likewise."""
    _, _, results = world
    targets = {"llama": "qkvo", "phi3": ["qkv", "o"], "gpt_bigcode": ["c_attn"]}[case]
    names = [f"{m}_proj" if case != "gpt_bigcode" else m for m in targets]
    prefix = "transformer.h" if case == "gpt_bigcode" else "model.layers"
    module = "attn" if case == "gpt_bigcode" else "self_attn"
    factors = {f"{prefix}.{i}.{module}.{m}.{f}" for i in range(4) for m in names for f in "AB"}
    for r in results:
        res = r["lora"][case]
        assert res["lora"]["logits"] < TOL and {n for n, _ in res["lora"]["grads"]} == factors, res["lora"]
        assert max(d for _, d in res["lora"]["grads"]) < TOL, res["lora"]["grads"]
        if "dora" in res:
            assert res["dora"]["logits"] < TOL, res["dora"]
            magnitudes = {f"{prefix}.{i}.{module}.{m}.m" for i in range(4) for m in names}
            assert {n for n, _ in res["dora"]["grads"]} == factors | magnitudes, res["dora"]["grads"]
            assert max(d for _, d in res["dora"]["grads"]) < TOL, res["dora"]["grads"]
        assert res["lora"]["loaded"] < TOL, res["lora"]
        kv = [f"{i}.self_attention.linear_qkv.lora.{m}_proj.B" for i in range(4) for m in "kv"] if case == "llama" \
            else [f"{i}.self_attention.linear_qkv.lora.{names[0]}.B" for i in range(4)]
        assert res["lora"]["marked"] == sorted(kv), res["lora"]["marked"]
    assert results[0]["lora"][case]["lora"]["folder"] < TOL, results[0]["lora"][case]


class _Reader:
    """A checkpoint reader over in-memory tensors (``get_slice`` with ``out``, as ``CheckpointReader``)."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype

    def get_slice(self, name, *, dim, start, stop, out=None):
        value = self.tensors[name].narrow(dim, start, stop - start)
        return value.clone() if out is None else out.copy_(value)


def test_mappings_replicate_kv_heads_gqa():
    """2 KV heads of 8 query heads over 4 ranks: each rank holds its 2 query heads and a replica of head rank // 2, in
    megatron's one-group layout ``[q, k, v]``; export (whole and streamed by parts) gives the HF tensors back, each
    K / V head from its first replica. QKV (three tensors), PackedQKV (Phi-3's one), GroupedQKV (Falcon's groups:
    ``[group, (4 q, k, v)]``), weights and a bias. A training checkpoint's head blocks (``head_blocks``) of the
    shards are megatron's whole-group tensor."""
    from loongforge_hf.bridges.fused_mappings import QKV
    from loongforge_hf.bridges.mappings import ShardContext
    from loongforge_hf.bridges.packed_mappings import GroupedQKV, PackedQKV
    from loongforge_hf.parallel.kv_replicas import head_blocks

    heads, kv, hd, hidden, tp = 8, 2, 3, 5, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * hd, hidden, generator=g) for n in (heads, kv, kv))
    bias = torch.randn((heads + 2 * kv) * hd, generator=g)
    qh, kh, vh = q.view(heads, hd, hidden), k.view(kv, hd, hidden), v.view(kv, hd, hidden)
    # the expected shard of rank t: q heads 2t, 2t + 1, then k and v of head t // 2
    expected = [torch.cat([qh[2 * t:2 * t + 2].reshape(-1, hidden), kh[t // 2], vh[t // 2]]) for t in range(tp)]
    grouped = torch.cat([torch.cat([qh[4 * h:4 * h + 4].reshape(-1, hidden), kh[h], vh[h]]) for h in range(kv)])
    bias_groups = bias.view(kv, 6 * hd)
    bias_expected = [torch.cat([bias_groups[t // 2, (t % 2) * 2 * hd:(t % 2 + 1) * 2 * hd],
                                bias_groups[t // 2, 4 * hd:]]) for t in range(tp)]
    cases = [(QKV("m", "q", "k", "v"), {"q": q, "k": k, "v": v}, expected),
             (PackedQKV("m", "qkv"), {"qkv": torch.cat([q, k, v])}, expected),
             (GroupedQKV("m", "qkv"), {"qkv": grouped}, expected),
             (GroupedQKV("m", "b"), {"b": bias}, bias_expected)]
    for mapping, tensors, want in cases:
        reader = _Reader(tensors)
        ctxs = [ShardContext(tp_rank=t, tp_size=tp, num_heads=heads, num_kv_heads=kv, head_dim=hd, vocab_size=1,
                             padded_vocab=4) for t in range(tp)]
        assert ctxs[0].kv_replicas == 2 and [c.first_kv_head(c.tp_rank) for c in ctxs] == [0, 0, 1, 1]
        shards = [mapping.load(reader, c, None) for c in ctxs]
        for t in range(tp):
            assert torch.equal(shards[t], want[t]), (type(mapping).__name__, t)
        exported = mapping.export(shards, ctxs[0], None)
        assert exported.keys() == tensors.keys() and all(torch.equal(exported[n], tensors[n]) for n in tensors)
        streamed = {n: torch.full_like(t, float("nan")) for n, t in tensors.items()}
        for t in range(tp):
            for name, dim, start, block in mapping.export_parts(shards[t], t, ctxs[0], None):
                region = streamed[name].narrow(dim, start, block.shape[dim])
                assert torch.isnan(region).all(), (type(mapping).__name__, name, start)  # NOTE: each row once
                region.copy_(block)
        assert all(torch.equal(streamed[n], tensors[n]) for n in tensors), type(mapping).__name__
    # a training checkpoint keys each rank's heads as blocks of the whole-group tensor (``grouped``; its replicas'
    # K / V once): the blocks of the four ranks' shards, main copies only, are that tensor
    for whole, shards in ((grouped, expected), (bias, bias_expected)):
        assembled = torch.full_like(whole, float("nan"))
        for t in range(tp):
            blocks = head_blocks(2, kv, 2, t, hd)
            assert (blocks.rows, blocks.total, blocks.replica) == (hd, heads + 2 * kv, (0, 0, t % 2, t % 2))
            for at, replica, rows in zip(blocks.at, blocks.replica, shards[t].split(hd)):
                assert torch.equal(whole[at * hd:(at + 1) * hd], rows), (t, at)
                if replica == 0:
                    assert torch.isnan(assembled[at * hd:(at + 1) * hd]).all(), (t, at)
                    assembled[at * hd:(at + 1) * hd] = rows
        assert torch.equal(assembled, whole)


def test_layouts_refused_before_any_collective():
    """Neither the KV heads nor the TP size dividing the other, and attention tensors that split by KV heads beyond
    q / k / v (per-head k norms, Qwen3.5's gated q projection): refused by the pure checks, naming the fields."""
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.parallel.kv_replicas import check_kv_replication
    from loongforge_hf.parallel import ParallelConfig, ParallelLayoutError
    from loongforge_hf.parallel.kv_replicas import query_groups, replicas_of
    from loongforge_hf.testing.tiny_models import _config

    with pytest.raises(ParallelLayoutError, match=r"num_key_value_heads=3 and tensor_parallel_size=2: one must divide"):
        ParallelConfig(tensor_parallel_size=2).check_model(num_layers=4, num_attention_heads=6, num_key_value_heads=3)
    ParallelConfig(tensor_parallel_size=8).check_model(num_layers=4, num_attention_heads=8, num_key_value_heads=2)
    assert (query_groups(2, 8), replicas_of(2, 8), query_groups(4, 2), replicas_of(4, 2)) == (8, 4, 4, 1)
    tp2 = ParallelConfig(tensor_parallel_size=2)
    check_kv_replication(get_bridge(_config("llama", num_key_value_heads=1, architectures=["LlamaForCausalLM"])), tp2)
    for arch, name, tensor in (("stablelm", "StableLmForCausalLM", "k_layernorm.weight"),
                               ("olmo2", "Olmo2ForCausalLM", "k_layernorm.weight"),
                               ("qwen3_5", "Qwen3_5ForCausalLM", "linear_qkv.weight")):
        bridge = get_bridge(_config(arch, num_key_value_heads=1, architectures=[name]))
        with pytest.raises(ParallelLayoutError, match=rf"tensor_parallel_size=2 is more than the 1 KV heads of "
                                                      rf"{bridge.architectures[0]}: .*{tensor}"):
            check_kv_replication(bridge, tp2)
