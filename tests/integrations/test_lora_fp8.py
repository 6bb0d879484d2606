"""LoRA and DoRA adapters on FP8-swapped linears (``fp8="on"``; the block-wise recipe emulated on CPU).

- ``disable_adapter()`` under FP8 runs the base model: the logits of the same FP8 model without adapters, bit for bit
  (the FP8 forward used to add the adapters there too), while outside the block the adapters move the logits.
- DoRA on an FP8 layer: its output is the FP8 base output plus DoRA's term computed on it (bias left out of the
  rescaling), within 1e-5, and the gradients of A, B and the magnitude are that formula's (1e-5 relative).
"""

from __future__ import annotations

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

from ._lora_fp8 import disable_checks, dora_layer_check


def test_disable_adapter_runs_the_fp8_base_model(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "src", "llama", tokenizer=False, num_hidden_layers=2, hidden_size=128,
                                  intermediate_size=256, head_dim=32)
    (r,) = run_distributed(disable_checks, 1, str(folder), timeout=240)
    assert r["swapped"] == 8
    for name in ("lora", "dora"):
        assert r[name]["adapter_effect"] > 1e-2, r
        assert r[name]["disabled_diff"] == 0.0, r


def test_dora_term_on_an_fp8_layer():
    (r,) = run_distributed(dora_layer_check, 1, timeout=240)
    assert r["swapped"] == 1 and r["dora_effect"] > 1e-1, r
    assert r["out_diff"] < 1e-5, r
    for key, value in r.items():
        if key.endswith("_grad_diff"):
            assert value < 1e-5, (key, r)
