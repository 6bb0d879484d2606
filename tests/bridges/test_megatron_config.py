"""``from_pretrained(megatron_config=...)``: extra megatron-core TransformerConfig fields reach the built model; a field
TransformerConfig lacks, or one the bridge or the layout sets, is refused before the process group starts."""

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _load_cases(folder: str) -> dict:
    import torch
    import torch.distributed as dist

    import loongforge_hf as lf

    out = {}
    for case, extra in (("unknown", {"no_such_field": 1}), ("from_checkpoint", {"num_layers": 3}),
                        ("from_layout", {"tensor_model_parallel_size": 2}),
                        ("cuda_graphs_on_cpu", {"cuda_graph_impl": "local"})):
        try:
            lf.AutoModelForCausalLM.from_pretrained(folder, megatron_config=extra)
            out[case] = ("no error", "", dist.is_initialized())
        except Exception as err:  # noqa: BLE001 - the test looks at what was raised
            out[case] = (type(err).__name__, str(err), dist.is_initialized())
    model = lf.AutoModelForCausalLM.from_pretrained(folder, megatron_config={"moe_shared_expert_overlap": True,
                                                                             "moe_router_force_load_balancing": True})
    config = model.megatron.config
    out["taken"] = (config.moe_shared_expert_overlap, config.moe_router_force_load_balancing)
    ids = torch.arange(4, 20).unsqueeze(0)
    out["finite"] = bool(torch.isfinite(model(input_ids=ids, labels=ids).loss).item())
    return out


def test_megatron_config(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=False)
    [out] = run_distributed(_load_cases, 1, str(folder), env={"LOONGFORGE_DEVICE": "cpu"})
    kind, message, started = out["unknown"]
    assert kind == "ValueError" and "no_such_field: not a megatron-core TransformerConfig field" in message
    assert not started
    kind, message, started = out["from_checkpoint"]
    assert kind == "ValueError" and "num_layers: set from the checkpoint's config or the layout" in message
    assert not started
    kind, message, started = out["from_layout"]
    assert kind == "ValueError" and "tensor_model_parallel_size: set from" in message and not started
    kind, message, started = out["cuda_graphs_on_cpu"]
    assert kind == "ValueError" and "CUDA graphs need a CUDA device" in message and not started
    assert out["taken"] == (True, True)
    assert out["finite"]


def test_local_cuda_graphs_refused_without_input_norms():
    """OLMo 2 / 3 have no input norm to keep the graphed first layer's input (builder._keep_graph_input): refused
    by the pure check from_pretrained runs before any collective, naming the architecture."""
    import pytest

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.bridges.builder import check_megatron_config
    from loongforge_hf.testing.tiny_models import _config

    for arch, name in (("olmo2", "Olmo2ForCausalLM"), ("olmo3", "Olmo3ForCausalLM")):
        config = _config(arch)
        config.architectures = [name]
        with pytest.raises(ValueError, match=f"cuda_graph_impl='local' is not supported for {name}: its layers have "
                                             "no input norm"):
            check_megatron_config(get_bridge(config), {"cuda_graph_impl": "local"})
