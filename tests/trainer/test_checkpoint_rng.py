"""megatron's model-parallel RNG states in a training checkpoint: written as plain state tensors that
``torch.load(weights_only=True)`` reads (no pickled code runs on resume), restored so that the streams continue
exactly; a graph-safe tracker's ``torch.Generator`` objects (megatron's CUDA graphs) keep their identity."""

import torch

from loongforge_hf.trainer.checkpoint import restore_rng_states, rng_states_to_save


class _Tracker:
    """megatron's CudaRNGStatesTracker interface: get_states() / set_states(states)."""

    def __init__(self, states):
        self.states_ = states

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    generator = torch.Generator().manual_seed(3)  # a graph-safe tracker holds generators
    torch.manual_seed(4)
    tracker = _Tracker({"model-parallel-rng": generator, "expert-parallel-rng": torch.get_rng_state()})
    path = tmp_path / "megatron_rng_0.pt"
    torch.save(rng_states_to_save(tracker), path)
    expected = torch.rand(5, generator=generator), torch.rand(5, generator=torch.Generator().set_state(
        tracker.states_["expert-parallel-rng"]))
    torch.rand(7, generator=generator)  # the run moves on after the save

    saved = torch.load(path, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in saved.values())
    restore_rng_states(tracker, saved)
    assert tracker.states_["model-parallel-rng"] is generator  # the same object, its state rewound
    assert torch.equal(torch.rand(5, generator=generator), expected[0])
    resumed = torch.Generator().set_state(tracker.states_["expert-parallel-rng"])
    assert torch.equal(torch.rand(5, generator=resumed), expected[1])
