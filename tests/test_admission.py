import pytest

from common.errors import InvalidRequest
from host.admission import Admission, Budgets
from host.errors import Overloaded


def test_per_request_caps_are_invalid_request():
    a = Admission(Budgets(max_inputs=2, max_input_bytes=10, max_request_bytes=15))
    with pytest.raises(InvalidRequest, match="must not be empty"):
        a.check_inputs([])
    with pytest.raises(InvalidRequest, match="at most 2"):
        a.check_inputs(["a", "b", "c"])
    with pytest.raises(InvalidRequest, match="11 bytes"):
        a.check_inputs(["x" * 11])
    with pytest.raises(InvalidRequest, match="request is 16 bytes"):
        a.check_inputs(["x" * 8, "y" * 8])
    with pytest.raises(InvalidRequest, match="expected a string"):
        a.check_inputs([None])


def test_inflight_budget_overloads_fast_and_releases():
    a = Admission(Budgets(max_inflight_tokens=100))
    with a.reserve(60):
        with pytest.raises(Overloaded) as info:
            with a.reserve(50):
                pass
        assert info.value.http_status == 429 and info.value.retry_after_s > 0
    with a.reserve(100):
        assert a.inflight_tokens == 100
    assert a.inflight_tokens == 0
