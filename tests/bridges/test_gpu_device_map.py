"""``from_pretrained(device_map=...)`` on the CUDA backend (one GPU, one process): the local rank's accelerator,
named by index, by ``"cuda"`` or by ``{"": index}``, loads there; another accelerator's index and the CPU are refused
with a message naming the device this process uses (``bridges/load_kwargs.py``: ``single_device``,
``check_device``)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _load_cases(folder: str) -> dict:
    import loongforge_hf as lf

    out = {}
    for name, device_map in (("index", 0), ("dict", {"": 0}), ("cuda", "cuda"), ("cuda0", "cuda:0"),
                             ("auto", "auto"), ("other", {"": torch.cuda.device_count()}), ("cpu", "cpu")):
        try:
            model = lf.AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, dtype=torch.float32)
            out[name] = ("ok", str(model.device), str(next(model.parameters()).device))
            del model
        except (ValueError, RuntimeError) as err:
            out[name] = (type(err).__name__, str(err), "")
    return out


def test_device_map_on_the_gpu(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny", "qwen3")
    r = run_distributed(_load_cases, 1, str(folder), timeout=300, env={"LOONGFORGE_DEVICE": "cuda"})[0]
    for name in ("index", "dict", "cuda", "cuda0", "auto"):
        assert r[name] == ("ok", "cuda:0", "cuda:0"), (name, r[name])
    # NOTE: checked once the process is bound to its device, inside the load's failing_alike block: every rank
    # raises from_pretrained's RuntimeError carrying the ValueError (naming the failing rank when there are several)
    kind, message, _ = r["other"]
    assert kind == "RuntimeError" and "ValueError: device_map names cuda:" in message, r["other"]
    assert "uses cuda:0" in message and "LOCAL_RANK=0" in message, r["other"]
    kind, message, _ = r["cpu"]
    assert kind == "ValueError" and "cpu" in message, r["cpu"]
