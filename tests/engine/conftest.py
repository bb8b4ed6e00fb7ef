import pytest
from flax import nnx

from jaxckpt.engine.scheduler import HybridRunner
from jaxckpt.models.hybrid import HybridConfig, HybridModel
from tests.engine.helpers import BUDGET, B


@pytest.fixture(scope="session")
def runner():
    # steps with prefill rows pad to one 128-token bucket, decode-only steps compile once per row count (1..4): the
    # engine tests compile the model five times. Every pool starts as NaN, so any read of a page or slot that no
    # forward wrote shows up in the logits.
    model = HybridModel(HybridConfig.tiny(block_size=B, max_model_len=256), rngs=nnx.Rngs(0))
    return HybridRunner(model, prefill_tokens=BUDGET, num_rows=4, fill=float("nan"))
