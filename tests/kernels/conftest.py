"""One 2-rank CPU world for the op-level distributed checks and one for the GPTModel layouts, shared by the tests
that read them (a failing rank's traceback fails each of those tests)."""

import pytest

from loongforge_hf.parallel.spawn import run_distributed

from ._distributed import GPT_LAYOUTS, gpt_checks, op_checks


@pytest.fixture(scope="session")
def distributed_op_results():
    return run_distributed(op_checks, 2, timeout=180)


@pytest.fixture(scope="session")
def gpt_layout_results():
    return run_distributed(gpt_checks, 2, GPT_LAYOUTS, timeout=240)
