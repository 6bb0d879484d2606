"""How the loader puts a checkpoint slice into a megatron parameter: adopted when it can serve as is, else copied."""

import torch

from loongforge_hf.bridges import loader

_fill = torch.no_grad()(loader._fill)  # load_into runs under no_grad


def test_a_fresh_slice_in_the_parameters_dtype_is_adopted_not_copied():
    param = torch.nn.Parameter(torch.empty(4, 3))
    param.tensor_model_parallel = True
    value = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    _fill(param, value)
    assert param.data_ptr() == value.data_ptr() and torch.equal(param, value)
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad and param.tensor_model_parallel


def test_another_dtype_or_a_view_is_copied():
    param = torch.nn.Parameter(torch.empty(4, 3))
    half = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)
    _fill(param, half)
    assert param.dtype == torch.float32 and torch.equal(param, half.float())

    big = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    for view in (big[4:], big[:4], big.t()[:, :4].t()):
        target = torch.nn.Parameter(torch.empty(4, 3))
        _fill(target, view)
        assert torch.equal(target, view) and target.data_ptr() != big.data_ptr()
        assert target.untyped_storage().nbytes() == 4 * 3 * 4  # never pins the larger tensor
