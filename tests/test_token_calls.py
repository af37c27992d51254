"""host.token_calls: what the token-level calls refuse before any lane is chosen or worker
started (the outputs asked, the prompt arguments, the inputs' budgets, a document without
chunks), through a real Module over an empty store. What they return is proved against
their references where the kinds are served (tests/test_multivector_heads.py,
tests/test_sparse_heads.py, tests/test_hf_xlmr.py)."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import InvalidRequest
from host.admission import Budgets
from host.module import Module, ModuleConfig


@pytest.fixture
def module(tmp_path):
    # No model in the store: a call that got as far as choosing a lane would fail with
    # model_not_found, not with the refusal each case expects.
    return Module(ModuleConfig(store_root=str(tmp_path), budgets=Budgets(max_inputs=2)))


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        ([], "ask for at least one output"),
        (["dense", "colour"], "unknown output 'colour'"),
        (["sparse", "sparse"], "each output may be asked once"),
    ],
)
async def test_the_outputs_asked_are_checked_first(module, outputs, match):
    with pytest.raises(InvalidRequest, match=match) as refused:
        await module.encode_outputs(["a"], outputs, "absent")
    assert refused.value.details["param"] == "outputs"
    with pytest.raises(InvalidRequest, match=match):
        await module.encode_token_ids([np.array([1, 2], np.int32)], outputs, "absent")
    assert module.served_lanes() == []


async def test_prompt_arguments_and_budgets_before_any_worker(module):
    with pytest.raises(InvalidRequest, match="pass prompt_name or prompt, not both"):
        await module.encode_outputs(["a"], ["tokens"], "absent", prompt_name="q", prompt="x")
    with pytest.raises(InvalidRequest, match="3 inputs; at most 2 per request"):
        await module.encode_outputs(["a", "b", "c"], ["tokens"], "absent")
    with pytest.raises(InvalidRequest, match="late chunking needs the document's chunks"):
        await module.late_chunk([], "absent")
    with pytest.raises(InvalidRequest, match="prompt must be a string"):
        await module.late_chunk(["a"], "absent", prompt=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="input 1 is int"):
        await module.late_chunk(["a", 1], "absent")  # type: ignore[list-item]
    assert module.served_lanes() == []
