"""The portable XLA path reproduces the shared vectors per their tolerance classes, through the public entries."""

import numpy as np
import pytest

from jaxckpt import ops
from tests.vectors.loader import check_case, load_cases

ENTRIES = {"gdn": ops.gated_delta_rule, "kda": ops.kda, "ssd": ops.ssd, "conv1d": ops.causal_conv1d}
CASES = [(op, case) for op in ENTRIES for case in load_cases(op)]


@pytest.mark.parametrize("op, case", CASES, ids=[f"{op}-{case.name}" for op, case in CASES])
def test_xla_matches_vectors(op, case):
    outputs = ENTRIES[op](**case.arguments, implementation="xla")
    check_case(case, [np.asarray(o) for o in outputs])
