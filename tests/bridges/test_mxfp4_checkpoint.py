import json

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from loongforge_hf.bridges.checkpoint_io import CheckpointError, CheckpointReader
from loongforge_hf.bridges.export_files import config_text
from loongforge_hf.bridges.fp8_checkpoint import DequantizingReader, dequantizing_reader, drop_dequantized_quantization
from loongforge_hf.bridges.mxfp4_checkpoint import Mxfp4Reader, dequantize_mxfp4, mxfp4_reader
from loongforge_hf.kernels.fp8 import dequantize, quantize_blocks

EXPERTS = "model.layers.{}.mlp.experts."
GATE_UP, DOWN = EXPERTS.format(0) + "gate_up_proj", EXPERTS.format(0) + "down_proj"


def _packed(experts: int, rows: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 131, (experts, rows, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


def _reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def folder(tmp_path):
    """gpt-oss-like experts of odd sizes (3 experts, hidden 96, intermediate 2 x 37 = 74 rows), in two shards."""
    tensors = {
        GATE_UP + "_blocks": _packed(3, 74, 3, seed=0)[0], GATE_UP + "_scales": _packed(3, 74, 3, seed=0)[1],
        GATE_UP + "_bias": torch.randn(3, 74).to(torch.bfloat16),
        DOWN + "_blocks": _packed(3, 96, 2, seed=1)[0], DOWN + "_scales": _packed(3, 96, 2, seed=1)[1],
        DOWN + "_bias": torch.randn(3, 96).to(torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(11, 96),
    }
    shards = {"a.safetensors": [GATE_UP + "_blocks", GATE_UP + "_bias", DOWN + "_scales", "model.embed_tokens.weight"],
              "b.safetensors": [GATE_UP + "_scales", DOWN + "_blocks", DOWN + "_bias"]}
    for shard, names in shards.items():
        save_file({n: tensors[n] for n in names}, tmp_path / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: s for s, names in shards.items() for n in names}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path, tensors


def test_reads_dequantised_like_transformers(folder):
    path, tensors = folder
    with CheckpointReader(path) as raw:
        reader = dequantizing_reader(raw)
        assert isinstance(reader, Mxfp4Reader) and mxfp4_reader(reader) is reader
        assert dequantizing_reader(reader) is reader
        assert sorted(reader.keys()) == sorted([GATE_UP, GATE_UP + "_bias", DOWN, DOWN + "_bias",
                                                "model.embed_tokens.weight"])
        assert len(reader) == 5 and GATE_UP in reader and GATE_UP + "_blocks" not in reader
        assert GATE_UP + "_scales" not in reader
        assert reader.shape(GATE_UP) == (3, 96, 74) and reader.shape(DOWN) == (3, 64, 96)
        assert reader.dtype(GATE_UP) == reader.dtype(DOWN) == torch.bfloat16
        assert reader.shard_of(GATE_UP) == "a.safetensors" and reader.shard_of(DOWN) == "b.safetensors"
        assert reader.folder == path
        for name in (GATE_UP, DOWN):
            want = _reference(tensors[name + "_blocks"], tensors[name + "_scales"])
            assert _same_bits(reader.get(name), want)
            assert _same_bits(dequantize_mxfp4(tensors[name + "_blocks"], tensors[name + "_scales"]), want)
        assert torch.equal(reader.get(GATE_UP + "_bias"), tensors[GATE_UP + "_bias"])
        assert torch.equal(reader.get_slice("model.embed_tokens.weight", dim=1, start=3, stop=40),
                           tensors["model.embed_tokens.weight"][:, 3:40])


class _Spy:
    """A reader that records the slices read from it."""

    def __init__(self, reader) -> None:
        self.reader, self.calls = reader, []

    def __getattr__(self, attr):
        return getattr(self.reader, attr)

    def get(self, name):
        self.calls.append((name, None, None, None))
        return self.reader.get(name)

    def get_slice(self, name, *, dim, start, stop, out=None):
        self.calls.append((name, dim, start, stop))
        return self.reader.get_slice(name, dim=dim, start=start, stop=stop, out=out)


@pytest.mark.parametrize("name", [GATE_UP, DOWN])
def test_slices(folder, name):
    path, tensors = folder
    with CheckpointReader(path) as raw:
        spy = _Spy(raw)
        reader = mxfp4_reader(spy)
        full = _reference(tensors[name + "_blocks"], tensors[name + "_scales"])
        for e in range(3):  # one expert at a time: only that expert's bytes are read
            spy.calls.clear()
            assert _same_bits(reader.get_slice(name, dim=0, start=e, stop=e + 1), full[e:e + 1])
            assert sorted(spy.calls) == [(name + "_blocks", 0, e, e + 1), (name + "_scales", 0, e, e + 1)]
        columns = reader.shape(name)[1]
        for dim, start, stop in ((0, 1, 3), (0, 0, 3), (0, 2, 2), (1, 0, columns), (1, 5, 37), (1, 32, 64),
                                 (1, 31, 33), (1, columns - 1, columns), (2, 0, 1), (2, 7, 50), (-1, 3, 9),
                                 (-2, 40, 41)):
            spy.calls.clear()
            got = reader.get_slice(name, dim=dim, start=start, stop=stop)
            assert _same_bits(got, full.narrow(dim, start, stop - start)), (dim, start, stop)
            if dim % 3 == 1:  # the 32-wide groups that cover the columns, and no more
                want = (start // 32, -(-stop // 32))
                assert {c[1:] for c in spy.calls} == {(2, *want)}
        into = torch.empty(2, *full.shape[1:], dtype=torch.bfloat16)
        assert reader.get_slice(name, dim=0, start=1, stop=3, out=into) is into
        assert _same_bits(into, full[1:3])
        into = torch.empty(3, 5, full.shape[2], dtype=torch.bfloat16)
        assert reader.get_slice(name, dim=1, start=30, stop=35, out=into) is into
        assert _same_bits(into, full[:, 30:35])
        with pytest.raises(CheckpointError, match="cannot read"):
            reader.get_slice(name, dim=0, start=0, stop=1, out=torch.empty(2, *full.shape[1:], dtype=torch.bfloat16))
        with pytest.raises(CheckpointError, match="cannot read"):
            reader.get_slice(name, dim=0, start=0, stop=1, out=torch.empty(1, *full.shape[1:]))
        for dim, start, stop in ((0, 2, 4), (3, 0, 1), (1, 5, 4), (-4, 0, 1)):
            with pytest.raises(CheckpointError, match="out of range"):
                reader.get_slice(name, dim=dim, start=start, stop=stop)


def test_edge_scales_match_transformers(tmp_path):
    """Every scale (0 and 255 included) against every byte: bit for bit what transformers reads."""
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16).expand(2, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(2, 256, 16).contiguous()
    scales[1] = scales[1].flip(0)
    save_file({"x_blocks": blocks, "x_scales": scales}, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as raw:
        got = mxfp4_reader(raw).get("x")
    want = _reference(blocks, scales)
    assert _same_bits(got, want)
    assert not got.isnan().any()
    lowest, highest = got[0, :, 0].float(), got[0, :, 255].float()  # scale 0, scale 255; code 1 is 0.5, 2 is 1.0
    assert lowest[2] == 2.0 ** -128 and lowest[4] == 2.0 ** -127  # bf16 subnormals, not flushed
    assert highest[2] == 2.0 ** 127 and highest[4] == float("inf") and highest[20] == -float("inf")
    assert highest[0] == highest[16] == 0 and not highest[0].signbit() and highest[16].signbit()  # +0, -0


def _write(tmp_path, tensors):
    save_file(tensors, tmp_path / "model.safetensors")
    return CheckpointReader(tmp_path)


@pytest.mark.parametrize("case, match", [
    ("no_scales", r"MXFP4 tensor 'w_blocks' has no 'w_scales'"),
    ("no_blocks", r"MXFP4 tensor 'w_scales' has no 'w_blocks'"),
    ("shape", r"expected blocks \[experts, rows, groups, 16\]"),
    ("last_dim", r"expected blocks \[experts, rows, groups, 16\]"),
    ("three_dims", r"expected blocks \[experts, rows, groups, 16\]"),
    ("scale_dtype", r"both must be uint8, found torch.uint8 / torch.float32"),
    ("both_ways", r"tensor 'w' is stored both plain and as MXFP4"),
])
def test_bad_mxfp4_tensors(tmp_path, case, match):
    blocks, scales = _packed(2, 5, 3, seed=2)
    tensors = {"w_blocks": blocks, "w_scales": scales, "other": torch.zeros(2)}
    if case == "no_scales":
        del tensors["w_scales"]
    elif case == "no_blocks":
        del tensors["w_blocks"]
    elif case == "shape":
        tensors["w_scales"] = scales[:, :4].contiguous()
    elif case == "last_dim":
        tensors["w_blocks"] = blocks[..., :8].contiguous()
    elif case == "three_dims":
        tensors["w_blocks"], tensors["w_scales"] = blocks[0], scales[0]
    elif case == "scale_dtype":
        tensors["w_scales"] = scales.float()
    else:
        tensors["w"] = torch.zeros(2, 96, 5)
    with _write(tmp_path, tensors) as raw:
        with pytest.raises(CheckpointError, match=match) as err:
            dequantizing_reader(raw)
    assert str(tmp_path) in str(err.value)


def test_other_blocks_tensors_left_alone(tmp_path):
    with _write(tmp_path, {"pos_blocks": torch.zeros(4, 3), "a_blocks": torch.zeros(2), "a_scales": torch.ones(2)}) \
            as raw:
        assert dequantizing_reader(raw) is raw


def test_with_fp8_weights_and_shape_checks(tmp_path):
    """MXFP4 experts and FP8 block-scaled weights in one checkpoint: one call wraps both."""
    w = torch.randn(130, 200, generator=torch.Generator().manual_seed(3))
    q = quantize_blocks(w)
    blocks, scales = _packed(2, 40, 2, seed=4)
    tensors = {"e.gate_up_proj_blocks": blocks, "e.gate_up_proj_scales": scales, "q.weight": q.data,
               "q.weight_scale_inv": q.scale, "n.weight": torch.ones(7)}
    with _write(tmp_path, tensors) as raw:
        reader = dequantizing_reader(raw)
        assert isinstance(reader, DequantizingReader) and dequantizing_reader(reader) is reader
        assert sorted(reader.keys()) == ["e.gate_up_proj", "n.weight", "q.weight"]
        assert _same_bits(reader.get("e.gate_up_proj"), _reference(blocks, scales))
        assert _same_bits(reader.get_slice("e.gate_up_proj", dim=0, start=1, stop=2), _reference(blocks, scales)[1:])
        torch.testing.assert_close(reader.get("q.weight"), dequantize(q, torch.bfloat16), rtol=0, atol=0)
        assert reader.dtype("e.gate_up_proj") == reader.dtype("q.weight") == torch.bfloat16
        reader.validate_shapes({"e.gate_up_proj": (2, 64, 40), "q.weight": (130, 200), "n.weight": (7,)})
        with pytest.raises(CheckpointError, match=r"'e.gate_up_proj': expected shape \(2, 40, 64\), found "
                                                  r"\(2, 64, 40\) \(stored as MXFP4\)"):
            reader.validate_shapes({"e.gate_up_proj": (2, 40, 64), "n.weight": (7,)})
        with pytest.raises(CheckpointError, match=r"'e.down_proj': missing"):
            reader.validate_shapes({"e.gate_up_proj": (2, 64, 40), "e.down_proj": (2, 64, 40)})


def test_export_drops_dequantized_quantization(tmp_path):
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    for qc, dropped in ((mxfp4, True), ({"quant_method": "fp8", "weight_block_size": [128, 128]}, True),
                        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, False)):
        config = {"model_type": "gpt_oss", "quantization_config": dict(qc)}
        assert drop_dequantized_quantization(config) is dropped
        assert ("quantization_config" in config) is not dropped
    assert drop_dequantized_quantization({"model_type": "gpt_oss"}) is False
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "quantization_config": mxfp4,
                                                      "torch_dtype": "bfloat16"}))
    written = json.loads(config_text(tmp_path, None, torch.bfloat16))
    assert "quantization_config" not in written and written["dtype"] == written["torch_dtype"] == "bfloat16"
