"""ParallelConfig validation, launcher environments, and parallel='auto'."""

import pytest
import torch

from loongforge_hf.parallel import ParallelConfig, ParallelLayoutError, accelerate_megatron_layout, read_launch_env
from loongforge_hf.parallel.auto import ModelSize, choose_layout
from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

GiB = 2**30


def test_sizes_must_be_positive_and_consistent():
    with pytest.raises(ParallelLayoutError, match="tensor_parallel_size must be a positive integer"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ParallelLayoutError, match="needs pipeline_parallel_size > 1"):
        ParallelConfig(virtual_pipeline_parallel_size=2)
    with pytest.raises(ParallelLayoutError, match="sequence_parallel=True needs tensor_parallel_size > 1"):
        ParallelConfig(sequence_parallel=True)


def test_world_and_model_checks_name_the_sizes():
    layout = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ParallelLayoutError, match="World size 6 is not divisible .* = 4"):
        layout.check_world_size(6)
    assert layout.data_parallel_size(8) == 2
    with pytest.raises(ParallelLayoutError, match="num_key_value_heads=3 and tensor_parallel_size=2: one must divide"):
        layout.check_model(num_layers=4, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ParallelLayoutError, match="num_experts=6 is not divisible by expert_parallel_size=4"):
        ParallelConfig(expert_parallel_size=4).check_model(num_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=4, num_experts=6)


def test_launch_environments():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 8, 1, "torchrun")
    assert read_launch_env({}).world_size == 1 and read_launch_env({}).launcher == "none"
    acc = {"ACCELERATE_USE_MEGATRON_LM": "true", "MEGATRON_LM_TP_DEGREE": "2", "MEGATRON_LM_PP_DEGREE": "4",
           "MEGATRON_LM_SEQUENCE_PARALLELISM": "True"}
    assert accelerate_megatron_layout(acc) == {"tensor_parallel_size": 2, "pipeline_parallel_size": 4,
                                               "sequence_parallel": True}
    assert accelerate_megatron_layout({"MEGATRON_LM_TP_DEGREE": "2"}) == {}


def test_auto_prefers_data_parallel_when_it_fits():
    small = ModelSize(num_params=int(0.6e9), num_layers=28, num_attention_heads=16, num_key_value_heads=8)
    layout, reason = choose_layout(small, world_size=8, local_world_size=8, device_memory=80 * GiB)
    assert (layout.tensor_parallel_size, layout.pipeline_parallel_size) == (1, 1)
    assert "TP=1 x PP=1 x DP=8" in reason


def test_auto_adds_tensor_then_pipeline_parallelism():
    big = ModelSize(num_params=int(13e9), num_layers=40, num_attention_heads=40, num_key_value_heads=8)
    layout, _ = choose_layout(big, world_size=8, local_world_size=8, device_memory=80 * GiB)
    assert layout.tensor_parallel_size > 1 and layout.sequence_parallel
    huge = ModelSize(num_params=int(200e9), num_layers=64, num_attention_heads=64, num_key_value_heads=8)
    layout, _ = choose_layout(huge, world_size=64, local_world_size=8, device_memory=80 * GiB)
    assert layout.tensor_parallel_size == 8 and layout.pipeline_parallel_size > 1
    with pytest.raises(ParallelLayoutError, match="does not fit 8 devices"):
        choose_layout(huge, world_size=8, local_world_size=8, device_memory=80 * GiB)


def test_auto_replicates_kv_heads_only_when_no_dividing_tp_fits(monkeypatch):
    """Two KV heads, four attention heads, 8 ranks: a TP of 4 (each KV head on 2 ranks, its K / V counted whole) only
    when TP 2 does not fit, and before a second pipeline stage; never where the model cannot replicate its heads
    (``kv_replication=False``; ``from_pretrained``'s check of the bridge: an OLMo 2's k norm spans the heads)."""
    import loongforge_hf.xpu
    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.modeling import _auto_layout
    from loongforge_hf.parallel.auto import model_size_of, state_bytes_per_rank, tp_candidates
    from loongforge_hf.testing.tiny_models import _config

    config = _config("llama", architectures=["LlamaForCausalLM"])
    size = model_size_of(config)
    assert (size.num_key_value_heads, size.kv_params) == (2, 4 * 2 * 64 * 16 * 2)
    assert tp_candidates(size, world_size=8, local_world_size=8) == ([1, 2], [4])
    assert tp_candidates(size, world_size=8, local_world_size=8, kv_replication=False) == ([1, 2], [])

    def need(tp, pp):
        return state_bytes_per_rank(size, tp=tp, pp=pp, dp=8 // (tp * pp), ep=1, dtype_bytes=2)

    # each TP4 rank holds one head's K / V whole: half the K / V, not a quarter
    assert need(4, 1) == pytest.approx((size.num_params - size.kv_params) / 4 * 10 + size.kv_params / 2 * 10)
    memory = need(4, 1) / 0.65 * 1.001  # NOTE: TP4 x DP2 just fits (35% kept for activations), TP2 x DP4 not
    assert need(2, 1) > 0.65 * memory >= need(2, 2)
    layout, reason = choose_layout(size, world_size=8, local_world_size=8, device_memory=memory)
    assert (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.sequence_parallel) == (4, 1, True)
    assert "TP=4 x PP=1 x DP=2 (each of the 2 KV heads on 2 ranks)" in reason, reason
    layout, reason = choose_layout(size, world_size=8, local_world_size=8, device_memory=memory,
                                   kv_replication=False)
    assert (layout.tensor_parallel_size, layout.pipeline_parallel_size) == (2, 2) and "KV heads" not in reason
    layout, reason = choose_layout(size, world_size=8, local_world_size=8, device_memory=4 * memory)
    assert layout.tensor_parallel_size == 1 and "KV heads" not in reason  # a dividing TP that fits wins

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "8")):
        monkeypatch.setenv(key, value)
    backend = type("Backend", (), {"memory_per_device": lambda self: memory})()
    monkeypatch.setattr(loongforge_hf.xpu, "get_backend", lambda: backend)
    olmo2 = _config("olmo2", architectures=["Olmo2ForCausalLM"])
    got = {name: _auto_layout(cfg, torch.bfloat16, get_bridge(cfg))
           for name, cfg in (("llama", config), ("olmo2", olmo2))}
    assert (got["llama"].tensor_parallel_size, got["olmo2"].tensor_parallel_size, got["olmo2"].pipeline_parallel_size) \
        == (4, 2, 2), got


def _auto_load(folder):
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, parallel="auto", dtype=torch.float32)
    return (model.parallel.tensor_parallel_size, model.parallel.pipeline_parallel_size)


def test_from_pretrained_auto(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3")
    assert run_distributed(_auto_load, 2, str(src), timeout=240) == [(1, 1), (1, 1)]
