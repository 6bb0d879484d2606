"""test_kv_replicas.py's two-rank checks on two GPUs of one host over NCCL: more TP ranks than KV heads (Llama,
Phi-3, GPTBigCode with one KV head at TP2 + SP) -- logits, the round trip, every gradient with the replicas' sum, two
engine steps with clipping against transformers stepped by hand (fp32, TF32 off; transformers on the CPU), the
replicas bit-equal after them, LoRA against PEFT. The test functions are test_kv_replicas.py's, collected here with
this module's ``world`` (pytest resolves a test's fixtures from the module that collects it)."""

import os

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .._device_env import pickleable_month_day_nano
from .test_kv_replicas import (CASES, test_engine_steps_match_transformers,  # noqa: F401
                               test_gradients_match_transformers, test_logits_and_round_trip,
                               test_lora_on_query_key_value_rows_matches_peft)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _cuda_checks(cases, root: str) -> dict:
    from tests.parallel._kv_replicas import kv_replica_checks

    pickleable_month_day_nano()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return kv_replica_checks(cases, root)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-replicas-gpu")
    folders = {name: str(make_tiny_checkpoint(root / name, arch, **kw)) for name, (arch, kw, _) in CASES.items()}
    cases = [(name, folders[name], precision) for name, (_, _, precision) in CASES.items()]
    results = run_distributed(_cuda_checks, 2, cases, str(root), timeout=600,
                              env={"LOONGFORGE_DEVICE": "cuda"})
    return root, folders, results
