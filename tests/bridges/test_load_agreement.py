"""A checkpoint whose tensors fail only on the ranks that read them (PP=2: each stage reads its own layers) must fail
``from_pretrained`` on every rank alike: no rank may return a model while another raised (its next collective would
hang). A tensor stored as an integer type is refused before the process group starts."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

INDEX = "model.safetensors.index.json"


def load_each(cases: dict) -> dict:
    import torch.distributed as dist

    import loongforge_hf as lf

    out = {}
    for name, (where, kwargs) in cases.items():
        try:
            lf.AutoModelForCausalLM.from_pretrained(where, **kwargs)
            out[name] = {"type": "no error", "message": "", "collective_started": dist.is_initialized()}
        except Exception as err:  # noqa: BLE001 - the test compares what each rank got
            out[name] = {"type": type(err).__name__, "message": str(err),
                         "collective_started": dist.is_initialized()}
    return out


def _store_as(folder, tensor: str, dtype: torch.dtype) -> str:
    shard = json.loads((folder / INDEX).read_text())["weight_map"][tensor]
    tensors = load_file(folder / shard)
    tensors[tensor] = tensors[tensor].to(dtype)
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    return shard


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    base = make_tiny_checkpoint(tmp / "base", "llama", tokenizer=False)
    int_gate = shutil.copytree(base, tmp / "int_gate")
    shard = _store_as(int_gate, "model.layers.1.mlp.gate_proj.weight", torch.int32)
    mixed_qkv = shutil.copytree(base, tmp / "mixed_qkv")
    _store_as(mixed_qkv, "model.layers.1.self_attn.q_proj.weight", torch.bfloat16)
    # NOTE: the int case first: it must fail before the process group starts
    cases = {"int_gate": (str(int_gate), {"pipeline_parallel_size": 2}),
             "mixed_qkv": (str(mixed_qkv), {"pipeline_parallel_size": 2, "dtype": torch.float32})}
    return shard, run_distributed(load_each, 2, cases, timeout=180)


def test_integer_tensor_refused_before_any_collective(outcomes):
    shard, results = outcomes
    rank0, rank1 = (r["int_gate"] for r in results)
    assert rank0["type"] == "CheckpointError", rank0
    assert (rank1["type"], rank1["message"]) == (rank0["type"], rank0["message"])
    for fragment in ("model.layers.1.mlp.gate_proj.weight", "torch.int32", shard, "expected floating point"):
        assert fragment in rank0["message"], (fragment, rank0["message"])
    assert not rank0["collective_started"] and not rank1["collective_started"]


def test_failure_on_one_pipeline_stage_fails_every_rank(outcomes):
    _, results = outcomes
    rank0, rank1 = (r["mixed_qkv"] for r in results)
    assert rank0["type"] == rank1["type"] == "RuntimeError", (rank0, rank1)
    assert rank1["message"] == rank0["message"]
    for fragment in ("mixed_qkv", "failed on rank 0", "model.layers.1.self_attn.q_proj.weight"):
        assert fragment in rank0["message"], (fragment, rank0["message"])
