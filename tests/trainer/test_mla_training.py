"""DeepSeek-V2/V3 (multi-latent attention, shared experts, a dense first layer) trained by the engine under the
layouts megatron's schedules drive, against one process: three optimizer steps of four micro-batches each (fp32,
AdamW, gradient clipping), losses and gradient norms within 1e-5 relative (what differs is where the layouts split
the sums). PP2 (1F1B; the dense first layer on the first stage), PP2 x VPP2 (interleaved, more micro-batches than
stages), TP2 + SP + EP2 (the KV latent at full width, ``bridges/mla_latent.py``) and CP2 x EP2.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

TOL = 1e-5
LAYOUTS = {
    "pp2": {"pipeline_parallel_size": 2},
    "pp2_vpp2": {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2},
    "tp2_sp_ep2": {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
                   "expert_tensor_parallel_size": 1},
    "cp2_ep2": {"context_parallel_size": 2, "expert_parallel_size": 2},
}
MODELS = {"deepseek_v3": ("deepseek_v3", {}), "deepseek_v2": ("deepseek_v2", {})}


def _micro_batches(step: int) -> list[dict]:
    ids = torch.randint(4, 203, (8, 16), generator=torch.Generator().manual_seed(step))
    return [{"input_ids": b, "labels": b} for b in ids.split(2)]


def _train(runs: list[tuple[str, str, dict]], out_dir: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    out = {}
    for name, folder, layout in runs:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        args = transformers.TrainingArguments(output_dir=f"{out_dir}/{name}", learning_rate=1e-2, weight_decay=0.1,
                                              max_grad_norm=0.5, report_to=[], use_cpu=True)
        engine = MegatronEngine(model, args=args)
        results = [engine.train_step(_micro_batches(step)) for step in range(3)]
        out[name] = {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results]}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("mla-train")
    folders = {n: str(make_tiny_checkpoint(base / n, arch, tokenizer=False, **kw)) for n, (arch, kw) in MODELS.items()}
    one = run_distributed(_train, 1, [(m, folders[m], {}) for m in MODELS], str(base / "one"), timeout=600)[0]
    runs = [(f"{layout}/{m}", folders[m], kw) for layout, kw in LAYOUTS.items() for m in MODELS]
    two = run_distributed(_train, 2, runs, str(base / "two"), timeout=900)
    return one, two


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_steps_match_one_process(results, layout, model):
    one, two = results
    ref = one[model]
    assert len(set(ref["losses"])) == 3  # the model trains: every step's loss differs
    for rank in two:
        got = rank[f"{layout}/{model}"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL), (got, ref)
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=TOL), (got, ref)


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory):
    """LoongTrainer on DeepSeek-V3 at TP2 + SP + EP2: the uninterrupted run's losses, and a run killed after its
    step-3 checkpoint (megatron's distributed checkpoint of MLA, shared and routed experts)."""
    from ._train_parity import train_loong_resumable

    base = tmp_path_factory.mktemp("mla-resume")
    src = str(make_tiny_checkpoint(base / "src", "deepseek_v3", tokenizer=False))
    layout = LAYOUTS["tp2_sp_ep2"]
    full = dict(run_distributed(train_loong_resumable, 2, src, str(base / "full"), layout, timeout=600)[0])
    killed = run_distributed(train_loong_resumable, 2, src, str(base / "killed"), layout, stop_after=3,
                             timeout=600)[0]
    assert [s for s, _ in killed] == [1, 2, 3]
    assert len(set(full.values())) == 6
    return src, full, base / "killed"


@pytest.mark.parametrize("resume_nprocs, resume_layout", [
    pytest.param(2, LAYOUTS["tp2_sp_ep2"], id="same-layout"),
    pytest.param(2, LAYOUTS["pp2"], id="tp2-sp-ep2-to-pp2"),
])
def test_resume_continues_the_same_losses(deepseek_run, tmp_path, resume_nprocs, resume_layout):
    """The killed run resumed in the same layout and in PP2: steps 4-6 log the uninterrupted run's losses (1e-5
    relative)."""
    import shutil

    from ._train_parity import train_loong_resumable

    src, full, killed = deepseek_run
    run = shutil.copytree(killed, tmp_path / "run")
    resumed = dict(run_distributed(train_loong_resumable, resume_nprocs, src, str(run), resume_layout,
                                   resume=str(run / "checkpoint-3"), timeout=600)[0])
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=TOL), (step, resumed[step], full[step])


def _train_one_part_optimizer(folder: str, out_dir: str) -> list:
    """As a loongforge-hf from before the routed experts were expert parameters in every layout: without expert
    parallelism megatron's optimizer was one part."""
    from loongforge_hf.trainer import engine

    from ._train_parity import train_loong_resumable

    engine._mark_expert_params = lambda chunks: None
    return train_loong_resumable(folder, out_dir, {}, stop_after=3)


def _resume_error(folder: str, out_dir: str) -> str:
    from loongforge_hf.bridges.checkpoint_files import CheckpointError

    from ._train_parity import train_loong_resumable

    try:
        train_loong_resumable(folder, out_dir, {}, resume=f"{out_dir}/checkpoint-3")
    except CheckpointError as err:
        return str(err)
    return "resumed"


def test_one_part_optimizer_checkpoint_is_refused_with_a_message(tmp_path):
    """A DeepSeek-V3 checkpoint whose optimizer was one part (written by the earlier rule) resumed now (a dense +
    expert chain): refused before megatron's load with what happened and the way out, not megatron's KeyError."""
    src = str(make_tiny_checkpoint(tmp_path / "src", "deepseek_v3", tokenizer=False))
    run_distributed(_train_one_part_optimizer, 1, src, str(tmp_path / "run"), timeout=300)
    message = run_distributed(_resume_error, 1, src, str(tmp_path / "run"), timeout=300)[0]
    assert "written by a one-part optimizer" in message and "from_pretrained(" in message, message
