"""A.X-K1's loading info on a checkpoint that, as the released ones, also holds the dense layers' ``post_mlp_layernorm``
(which transformers ignores: ``_keys_to_ignore_on_load_unexpected`` matches ``mlp.post_mlp_layernorm``, the name its
conversion mapping gives ``post_mlp_layernorm`` on load): equal to transformers' on the same folder, without a world
(``loading_info`` runs before the process group starts, on what ``from_pretrained`` reads). Parity and round trips:
test_moe_parity; the dense norms passed through on export: test_decoders_2026."""

import torch
import transformers
from safetensors.torch import load_file, save_file

from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_models import hf_causal_lm


def test_axk1_dense_layer_norms_not_unexpected(tmp_path):
    """Dense layers 0 and 2 carry ``post_mlp_layernorm.weight`` on disk: neither listed as unexpected, as transformers
    lists neither; a tensor no model reads still is, in both."""
    from loongforge_hf.bridges.checkpoint_io import CheckpointReader
    from loongforge_hf.bridges.fp8_checkpoint import dequantizing_reader
    from loongforge_hf.bridges.load_kwargs import loading_info, transformers_names
    from loongforge_hf.bridges.registry import get_bridge

    src = make_tiny_checkpoint(tmp_path / "axk1", "axk1", tokenizer=False, max_shard_size="10GB")
    g = torch.Generator().manual_seed(0)
    dense = {f"model.layers.{i}.post_mlp_layernorm.weight": torch.randn(64, generator=g) for i in (0, 2)}
    save_file({**load_file(src / "model.safetensors"), **dense, "model.layers.0.unused_probe.weight": torch.ones(3)},
              src / "model.safetensors", metadata={"format": "pt"})
    _, theirs = hf_causal_lm(src, dtype=torch.float32, output_loading_info=True)
    with CheckpointReader(src) as reader:
        bridge = get_bridge(transformers.AutoConfig.from_pretrained(src))
        dequantizing_reader(reader, bridge=bridge).validate_shapes(bridge.expected_hf_shapes())
        mine = loading_info(reader, bridge)
    assert mine == theirs, (mine, theirs)
    assert mine["unexpected_keys"] == {"model.layers.0.unused_probe.weight"} and not mine["missing_keys"]
    renamed = transformers_names(dense, architecture="AXK1ForCausalLM", model_type="axk1")
    assert renamed == {n: n.replace(".post_mlp", ".mlp.post_mlp") for n in dense}
