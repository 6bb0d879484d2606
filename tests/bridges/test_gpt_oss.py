"""gpt-oss as the hub ships it: the routed experts in MXFP4 (``*_blocks`` / ``*_scales``, ``quantization_config``
mxfp4). The tiny checkpoint's experts are quantised here to FP4 e2m1 values with one power-of-two scale per 32
inputs; loongforge-hf loads that folder (dequantised on load, ``bridges/mxfp4_checkpoint.py``) at EP2 and TP2 + SP,
and its logits and loss must equal (1e-5, fp32) transformers' on the same dequantised weights, as transformers
itself loads the folder with ``Mxfp4Config(dequantize=True)`` (which ``from_pretrained`` accepts too); the export is
a plain checkpoint (no ``quantization_config``) that transformers loads to the same logits. Also: a
SequentialMLP request is refused for gpt-oss, naming the switch.

Parity in every layout, gradients and cached generate on the unquantised tiny gpt-oss: ``test_moe_parity.py``,
``test_gradients.py``, ``test_generation_cache.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-5
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
STACKED = ("gate_up_proj", "down_proj")


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, rows, cols]`` (cols a multiple of 32) -> (blocks uint8 ``[E, rows, cols / 32, 16]``, scales uint8
    ``[E, rows, cols / 32]``): per 32 values a power-of-two scale putting the largest at most 6, each value the
    nearest e2m1 code (sign bit 8), two codes per byte, the even element in the low nibble."""
    e, rows, cols = w.shape
    groups = w.float().reshape(e, rows, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    index = (scaled.abs().unsqueeze(-1) - FP4_GRID).abs().argmin(-1)
    codes = (index + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def _mxfp4_folder(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``src`` with its experts' weights in MXFP4 (the hub's layout) at ``dst``; returns the dequantised weights
    transformers' own routine gives for them, by HF name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst.mkdir()
    dequantised = {}
    index = {"metadata": {}, "weight_map": {}}
    for file in sorted(src.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(file).items():
            if not name.endswith(STACKED):
                tensors[name] = t
                continue
            # NOTE: transformers' dequantised tensor is the blocks' [E, out, in] transposed to [E, in, out]
            blocks, scales = _quantize_mxfp4(t.transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            dequantised[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        save_file(tensors, dst / file.name, metadata={"format": "pt"})
        index["weight_map"].update({n: file.name for n in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            (dst / extra.name).write_bytes(extra.read_bytes())
    return dequantised


def _reference(src: Path, dequantised: dict[str, torch.Tensor]):
    """transformers' gpt-oss with ``src``'s weights and the dequantised experts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in dequantised.items():
            params[name].copy_(t.float())
    return model


def _load_quantised(folder: str, out: str, layout: dict) -> dict:
    import transformers

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True), **layout)
    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(5))
    out_ = model(input_ids=ids, labels=ids)
    model.save_pretrained(out)
    return {"logits": out_.logits.detach(), "loss": out_.loss.item()}


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    # NOTE: hidden and expert widths multiples of 32 (MXFP4's groups), as gpt-oss's (2880)
    src = make_tiny_checkpoint(base / "src", "gpt_oss", hidden_size=64, intermediate_size=64)
    dequantised = _mxfp4_folder(src, base / "mxfp4")
    return src, base / "mxfp4", dequantised


@pytest.mark.parametrize("layout", [{"expert_parallel_size": 2},
                                    {"tensor_parallel_size": 2, "sequence_parallel": True}],
                         ids=["ep2", "tp2_sp"])
def test_mxfp4_checkpoint_loads_as_transformers_and_exports_plain(quantised, tmp_path, layout):
    src, folder, dequantised = quantised
    ref = _reference(src, dequantised)
    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exp = ref(input_ids=ids, labels=ids)
    # NOTE: transformers itself reads the MXFP4 folder to the same model (its dequantising load, on CPU)
    hf_loaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    with torch.no_grad():
        torch.testing.assert_close(hf_loaded(input_ids=ids).logits, exp.logits, atol=TOL, rtol=0)
    out = tmp_path / "export"
    got = run_distributed(_load_quantised, 2, str(folder), str(out), layout, timeout=300)
    for rank in got:
        assert (rank["logits"] - exp.logits).abs().max().item() < TOL, rank
        assert abs(rank["loss"] - exp.loss.item()) < TOL
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    written = {}
    for file in out.glob("*.safetensors"):
        written.update(load_file(file))
    assert not [n for n in written if n.endswith(("_blocks", "_scales"))]
    for name, t in dequantised.items():
        assert torch.equal(written[name].float(), t.float()), name
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, exp.logits, atol=TOL, rtol=0)


def _packed_row(folder: str) -> dict:
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                    sequence_parallel=True)
    ids, positions = _packed_inputs()
    with torch.no_grad():
        return {"packed": model(input_ids=ids, position_ids=positions).logits,
                "alone": [model(input_ids=ids[:, a:b]).logits for a, b in ((0, 17), (17, 30))]}


def _packed_inputs():
    ids = torch.randint(4, 200, (1, 30), generator=torch.Generator().manual_seed(1))
    return ids, torch.cat([torch.arange(17), torch.arange(13)])[None]


def test_packed_documents_attend_only_to_themselves(tmp_path):
    """A padding-free row of two documents (positions restarting at 0, as TRL packs them): each document's logits
    are its own, as transformers gives them for the document alone (transformers' eager gpt-oss attention, the only
    one with sinks on CPU, lets the second document see the first: 0.07 off there; flash / flex attention do not)."""
    src = make_tiny_checkpoint(tmp_path / "src", "gpt_oss", tokenizer=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids, _ = _packed_inputs()
    with torch.no_grad():
        alone = [ref(input_ids=ids[:, a:b]).logits for a, b in ((0, 17), (17, 30))]
    for rank in run_distributed(_packed_row, 2, str(src), timeout=300):
        torch.testing.assert_close(rank["packed"], torch.cat(alone, dim=1), atol=TOL, rtol=0)
        for ours, theirs in zip(rank["alone"], alone):
            torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)


def test_sequential_experts_refused(monkeypatch, tmp_path):
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.moe import GROUPED_GEMM_ENV

    src = make_tiny_checkpoint(tmp_path / "src", "gpt_oss", tokenizer=False)
    config = transformers.AutoConfig.from_pretrained(src)
    monkeypatch.setenv(GROUPED_GEMM_ENV, "0")
    with pytest.raises(UnsupportedConfigError, match=f"{GROUPED_GEMM_ENV}=0 .*GptOssForCausalLM"):
        get_bridge(config)
    monkeypatch.setenv(GROUPED_GEMM_ENV, "1")
    assert get_bridge(config).grouped_experts
