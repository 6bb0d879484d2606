import pytest
import torch

from loongforge_hf.bridges.transforms import (
    fuse_gate_up,
    fuse_qkv,
    pad_vocab,
    padded_vocab_size,
    qkv_blocks,
    shard_range,
    split_gate_up,
    split_qkv,
    truncate_vocab,
)

# (num_heads, num_kv_heads, head_dim): multi-head, grouped-query, multi-query, odd sizes
HEAD_LAYOUTS = [(4, 4, 8), (8, 2, 4), (6, 1, 5), (12, 3, 7)]


def reference_fuse_qkv(q, k, v, num_heads, num_kv_heads, head_dim):
    """megatron-core linear_qkv written out group by group."""
    per_group = num_heads // num_kv_heads
    rows = []
    for g in range(num_kv_heads):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * head_dim:(h + 1) * head_dim])
        rows.append(k[g * head_dim:(g + 1) * head_dim])
        rows.append(v[g * head_dim:(g + 1) * head_dim])
    return torch.cat(rows, dim=0)


def bits(t):
    """The raw bits of a float tensor, so equality is bit-exact (-0.0 != 0.0)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def random_qkv(num_heads, num_kv_heads, head_dim, hidden=None, dtype=torch.float32):
    trailing = () if hidden is None else (hidden,)
    g = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads * 10 + head_dim)
    q = torch.randn(num_heads * head_dim, *trailing, generator=g).to(dtype)
    k = torch.randn(num_kv_heads * head_dim, *trailing, generator=g).to(dtype)
    v = torch.randn(num_kv_heads * head_dim, *trailing, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("hidden", [None, 13], ids=["bias", "weight"])
def test_fuse_qkv_matches_per_group_reference(layout, hidden):
    nh, nkv, hd = layout
    q, k, v = random_qkv(nh, nkv, hd, hidden)
    fused = fuse_qkv(q, k, v, num_heads=nh, num_kv_heads=nkv, head_dim=hd)
    assert fused.shape == ((nh + 2 * nkv) * hd, *(() if hidden is None else (hidden,)))
    assert torch.equal(fused, reference_fuse_qkv(q, k, v, nh, nkv, hd))


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_split_qkv_inverts_fuse_bit_exact(layout, dtype):
    nh, nkv, hd = layout
    for hidden in (None, 9):
        q, k, v = random_qkv(nh, nkv, hd, hidden, dtype)
        q2, k2, v2 = split_qkv(fuse_qkv(q, k, v, num_heads=nh, num_kv_heads=nkv, head_dim=hd),
                               num_heads=nh, num_kv_heads=nkv, head_dim=hd)
        for a, b in ((q, q2), (k, k2), (v, v2)):
            assert b.dtype == dtype and b.is_contiguous()
            assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("layout,tp", [((8, 2, 4), 2), ((12, 4, 3), 4), ((4, 4, 8), 4), ((16, 8, 2), 2)])
def test_tp_sliced_fusion_equals_row_chunk_of_full_fusion(layout, tp):
    nh, nkv, hd = layout
    q, k, v = random_qkv(nh, nkv, hd, 11)
    full = fuse_qkv(q, k, v, num_heads=nh, num_kv_heads=nkv, head_dim=hd)
    local_nh, local_nkv = nh // tp, nkv // tp
    chunk = full.shape[0] // tp
    for rank in range(tp):
        q_r = q[rank * local_nh * hd:(rank + 1) * local_nh * hd]
        k_r = k[rank * local_nkv * hd:(rank + 1) * local_nkv * hd]
        v_r = v[rank * local_nkv * hd:(rank + 1) * local_nkv * hd]
        local = fuse_qkv(q_r, k_r, v_r, num_heads=local_nh, num_kv_heads=local_nkv, head_dim=hd)
        assert torch.equal(local, full[rank * chunk:(rank + 1) * chunk])
    # and the export direction: splitting every rank's chunk with local counts gives back the HF slices
    q_parts, k_parts, v_parts = zip(*(split_qkv(full[r * chunk:(r + 1) * chunk], num_heads=local_nh,
                                                num_kv_heads=local_nkv, head_dim=hd) for r in range(tp)))
    assert torch.equal(torch.cat(q_parts), q) and torch.equal(torch.cat(k_parts), k)
    assert torch.equal(torch.cat(v_parts), v)


def test_fuse_qkv_accepts_non_contiguous_inputs():
    q, k, v = random_qkv(4, 2, 3, 6)
    qt, kt, vt = (t.t().contiguous().t() for t in (q, k, v))
    assert not qt.is_contiguous()
    assert torch.equal(fuse_qkv(qt, kt, vt, num_heads=4, num_kv_heads=2, head_dim=3),
                       fuse_qkv(q, k, v, num_heads=4, num_kv_heads=2, head_dim=3))


def test_qkv_argument_errors():
    q, k, v = random_qkv(6, 2, 4, 5)
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be divisible by num_kv_heads \(4\)"):
        fuse_qkv(q, k, v, num_heads=6, num_kv_heads=4, head_dim=4)
    with pytest.raises(ValueError, match="q .* must have 48 rows, got shape \\(24, 5\\)"):
        fuse_qkv(q, k, v, num_heads=12, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="k .* must have 4 rows"):
        fuse_qkv(q, k, v, num_heads=6, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="agree past dim 0"):
        fuse_qkv(q, k[:, :3], v, num_heads=6, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="one dtype"):
        fuse_qkv(q, k.half(), v, num_heads=6, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        fuse_qkv(q, k, v, num_heads=6, num_kv_heads=2, head_dim=0)
    fused = fuse_qkv(q, k, v, num_heads=6, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="qkv .* must have 48 rows, got shape \\(40, 5\\)"):
        split_qkv(fused, num_heads=8, num_kv_heads=2, head_dim=4)


@pytest.mark.parametrize("heads,groups,hd,rest", [(6, 2, 4, (5,)), (8, 8, 2, (3,)), (4, 1, 3, ())])
def test_qkv_blocks_place_rows_as_fuse_qkv(heads, groups, hd, rest):
    q, k, v = (torch.randn(n * hd, *rest) for n in (heads, groups, groups))
    fused = fuse_qkv(q, k, v, num_heads=heads, num_kv_heads=groups, head_dim=hd)
    blocks = qkv_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd)
    assert len(blocks) == 3 * groups
    built = torch.full_like(fused, float("nan"))
    for which, src, dst, rows in blocks:
        built[dst:dst + rows] = (q, k, v)[which][src:src + rows]
    assert torch.equal(built, fused)  # every row placed once (no NaN left), each where fuse_qkv puts it
    for which, n in enumerate((heads, groups, groups)):
        assert sum(rows for w, _, _, rows in blocks if w == which) == n * hd


def test_gate_up_layout_and_round_trip():
    gate, up = torch.randn(10, 6), torch.randn(10, 6)
    fc1 = fuse_gate_up(gate, up)
    assert torch.equal(fc1[:10], gate) and torch.equal(fc1[10:], up)
    g2, u2 = split_gate_up(fc1)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    # biases, and a TP rank's local fc1 ([gate_r; up_r]) splits the same way
    gb, ub = torch.randn(10), torch.randn(10)
    assert [torch.equal(a, b) for a, b in zip(split_gate_up(fuse_gate_up(gb[5:], ub[5:])), (gb[5:], ub[5:]))] \
        == [True, True]


def test_gate_up_errors():
    with pytest.raises(ValueError, match="one shape and dtype"):
        fuse_gate_up(torch.zeros(4, 3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="one shape and dtype"):
        fuse_gate_up(torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"even number of rows.*\(7, 3\)"):
        split_gate_up(torch.zeros(7, 3))


@pytest.mark.parametrize("vocab,tp,multiple,expected", [
    (50257, 1, 128, 50304),      # GPT-2, megatron's classic example
    (32000, 1, 128, 32000),      # already a multiple
    (32000, 8, 128, 32768),
    (151936, 8, 128, 152576),
    (100, 3, 1, 102),
    (1, 2, 64, 128),
])
def test_padded_vocab_size(vocab, tp, multiple, expected):
    got = padded_vocab_size(vocab, tensor_parallel_size=tp, multiple=multiple)
    assert got == expected and got % (multiple * tp) == 0 and got >= vocab


def test_padded_vocab_size_errors():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        padded_vocab_size(100, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="vocab_size"):
        padded_vocab_size(-3, tensor_parallel_size=1)


def test_pad_and_truncate_vocab():
    weight = torch.randn(50, 8)
    padded = pad_vocab(weight, 64)
    assert padded.shape == (64, 8) and torch.equal(padded[:50], weight)
    assert torch.count_nonzero(padded[50:]) == 0
    assert torch.equal(truncate_vocab(padded, 50), weight)
    bias = torch.randn(50)
    assert torch.equal(truncate_vocab(pad_vocab(bias, 56), 50), bias)
    assert pad_vocab(weight, 50) is weight  # nothing to pad: the tensor itself, no copy
    assert pad_vocab(weight[:0], 4).shape == (4, 8)  # a TP rank whose rows are all padding
    with pytest.raises(ValueError, match=r"shape \(50, 8\) to 49 rows"):
        pad_vocab(weight, 49)
    with pytest.raises(ValueError, match=r"shape \(50, 8\) to 51 rows"):
        truncate_vocab(weight, 51)


def test_shard_range_covers_evenly():
    ranges = [shard_range(24, rank=r, world=4, name="x") for r in range(4)]
    assert ranges == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert shard_range(7, rank=0, world=1) == (0, 7)


def test_shard_range_errors_name_the_tensor():
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*size 10 .* 4 ranks"):
        shard_range(10, rank=0, world=4, name="model.embed_tokens.weight")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        shard_range(10, rank=2, world=2, name="w")
    with pytest.raises(ValueError, match="world must be a positive integer"):
        shard_range(10, rank=0, world=0)


class _CopyingReader:
    """A reader wrapper without ``out=`` (like the FP8 dequantising reader): mappings copy its slices into place."""

    def __init__(self, reader) -> None:
        self.reader = reader

    def __getattr__(self, item):
        return getattr(self.reader, item)

    def get_slice(self, name, *, dim, start, stop):
        return self.reader.get_slice(name, dim=dim, start=start, stop=stop)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mappings_load_in_place_and_export_blocks(tmp_path, tp):
    """Each mapping's load equals the slice-then-transform reference (read straight into place, or copied there by a
    reader wrapper); every rank's ``export_parts`` blocks rebuild exactly what ``export`` builds from all shards."""
    from safetensors.torch import save_file

    from loongforge_hf.bridges.checkpoint_io import CheckpointReader
    from loongforge_hf.bridges.fused_mappings import QKV, GatedMLP
    from loongforge_hf.bridges.mappings import (ColumnParallel, Replicated, RowParallel, ShardContext, VocabParallel,
                                                streams_export)
    from loongforge_hf.bridges.packed_mappings import PackedGatedMLP, PackedQKV

    heads, groups, hd, hidden, vocab = 8, 4, 3, 6, 203
    padded = padded_vocab_size(vocab, tensor_parallel_size=tp, multiple=64)  # 256 at TP 4: a rank of padding only
    state = {"q": torch.randn(heads * hd, hidden), "k": torch.randn(groups * hd, hidden),
             "v": torch.randn(groups * hd, hidden), "qb": torch.randn(heads * hd), "kb": torch.randn(groups * hd),
             "vb": torch.randn(groups * hd), "gate": torch.randn(16, hidden), "up": torch.randn(16, hidden),
             "o": torch.randn(hidden, heads * hd), "emb": torch.randn(vocab, hidden), "norm": torch.randn(hidden),
             "col": torch.randn(8, hidden)}
    # NOTE: Phi-3's packing: [q; k; v] and [gate; up] rows in one tensor each
    state.update(qkv_packed=torch.cat([state["q"], state["k"], state["v"]]),
                 gate_up_packed=torch.cat([state["gate"], state["up"]]))
    save_file(state, str(tmp_path / "model.safetensors"))
    mappings = [QKV("qkv", "q", "k", "v"), QKV("qkv_bias", "qb", "kb", "vb"), GatedMLP("fc1", "gate", "up"),
                RowParallel("proj", "o"), VocabParallel("embedding", "emb"), Replicated("ln", "norm"),
                ColumnParallel("col", "col"), PackedQKV("qkv", "qkv_packed"),
                PackedGatedMLP("fc1", "gate_up_packed", intermediate_size=16)]

    def reference(m, r):
        def part(t, dim=0):
            return t.chunk(tp, dim=dim)[r]
        if isinstance(m, (QKV, PackedQKV)):
            q, k, v = (state[n] for n in m.hf_names(None)) if isinstance(m, QKV) else (state["q"], state["k"],
                                                                                       state["v"])
            return fuse_qkv(part(q), part(k), part(v), num_heads=heads // tp, num_kv_heads=groups // tp, head_dim=hd)
        if isinstance(m, (GatedMLP, PackedGatedMLP)):
            return fuse_gate_up(part(state["gate"]), part(state["up"]))
        if isinstance(m, VocabParallel):
            return pad_vocab(state["emb"], padded).chunk(tp)[r]
        return {"proj": part(state["o"], 1), "ln": state["norm"], "col": part(state["col"])}[m.megatron]

    with CheckpointReader(tmp_path) as reader:
        for m in mappings:
            assert streams_export(m), m
            ctxs = [ShardContext(tp_rank=r, tp_size=tp, num_heads=heads, num_kv_heads=groups, head_dim=hd,
                                 vocab_size=vocab, padded_vocab=padded) for r in range(tp)]
            shards = []
            for r, ctx in enumerate(ctxs):
                loaded = m.load(reader, ctx, None)
                assert torch.equal(loaded, reference(m, r)), (m, r)
                assert torch.equal(m.load(_CopyingReader(reader), ctx, None), loaded), (m, r)
                assert loaded.untyped_storage().nbytes() == loaded.numel() * loaded.element_size()
                shards.append(loaded)
            if hasattr(m, "rows_to_megatron"):  # NOTE: a LoRA B's / DoRA magnitude's rows go where the weight's go
                permuted = m.rows_to_megatron(state[m.hf], ctxs[0])
                assert torch.equal(permuted, torch.cat(shards)) and torch.equal(m.rows_to_hf(permuted, ctxs[0]),
                                                                                state[m.hf]), m
            whole = m.export(shards, ctxs[0], None)
            rebuilt = {n: torch.full_like(t, float("nan")) for n, t in whole.items()}
            covered = {n: 0 for n in whole}
            for r, shard in enumerate(shards):
                for name, dim, start, block in m.export_parts(shard, r, ctxs[0], None):
                    rebuilt[name].narrow(dim, start, block.shape[dim]).copy_(block)
                    covered[name] += block.numel()
            for name, tensor in whole.items():
                assert covered[name] == tensor.numel() and torch.equal(rebuilt[name], tensor), (m, name)
                assert torch.equal(tensor, state[name]), (m, name)
