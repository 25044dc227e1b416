"""The vLLM releases rlsync drives, and its own record of which weight version made which tokens
where vLLM keeps none (vllm_versions): pure logic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed here (a GPU machine before its parts)")

from rlsync.errors import FailedPrecondition
from rlsync.rollout.engines.vllm_versions import SwitchPoints, check, owner, switch_all


@pytest.mark.parametrize("version", ["0.20.2", "0.20.0", "0.25.1", "0.32.0", "0.32.1+cpu"])
def test_supported_releases_pass(version):
    check(version)


@pytest.mark.parametrize("version", ["0.19.1", "0.33.0", "1.0.0", "dev"])
def test_other_releases_are_refused_in_one_line_naming_the_supported_ones(version):
    with pytest.raises(FailedPrecondition) as e:
        check(version)
    assert "\n" not in str(e.value) and "0.20" in str(e.value) and "0.32" in str(e.value) and version in str(e.value)


def test_a_switch_splits_a_completion_at_the_tokens_produced_before_it():
    points = SwitchPoints(3)
    points.switch(0, 5, 4)  # completion 0 had made 5 tokens on version 3
    points.switch(1, 0, 4)  # completion 1 had made none: all of it is version 4's
    assert points.spans(0, 12) == [(3, 0, 5), (4, 5, 7)]
    assert points.spans(1, 12) == [(4, 0, 12)]
    assert [points.version_at(0, i) for i in (0, 4, 5, 11)] == [3, 3, 4, 4]
    assert points.spans(2, 3) == [(3, 0, 3)]


@given(st.integers(0, 40), st.lists(st.tuples(st.integers(0, 50), st.integers(1, 5)), max_size=4))
def test_spans_cover_every_token_once_in_version_order(total, switches):
    points, version = SwitchPoints(0), 0
    for produced, step in sorted(switches):
        version += step
        points.switch(0, produced, version)
    spans = points.spans(0, total)
    assert sum(n for _, _, n in spans) == total
    assert all(s == sum(n for _, _, n in spans[:i]) for i, (_, s, _) in enumerate(spans))
    assert [v for v, _, _ in spans] == sorted({v for v, _, _ in spans})
    assert all(points.version_at(0, s + k) == v for v, s, n in spans for k in range(n))


def test_vllms_ids_for_a_completion_name_the_request_and_index_they_belong_to():
    completions = {"req-1": 1, "req_2": 1, "abc": 3, "x-y": 2}
    assert owner("req-1-0123abcd", completions) == ("req-1", 0)
    assert owner("req_2-0123abcd", completions) == ("req_2", 0)
    assert owner("2_abc-0123abcd", completions) == ("abc", 2)
    assert owner("1_x-y-0123abcd", completions) == ("x-y", 1)
    assert owner("req-1", completions) == ("req-1", 0)  # (vLLM's suffix switched off)
    assert owner("7_abc", completions) == ("abc", 7)
    assert owner("other-0123abcd", completions) is None
    assert owner("1_req-1-0123abcd", completions) is None  # (req-1 has one completion: no children)


def test_a_commit_switches_each_completion_at_its_count_and_one_with_none_by_whether_it_had_begun():
    switches = {"a": SwitchPoints(0, 2), "b": SwitchPoints(0), "c": SwitchPoints(0)}
    switches["c"].produced[0] = 5  # handed out 5 tokens, then vLLM's record of it was gone: it ended before
    switch_all(switches, {"a": {0: 3, 1: 4}}, 1, ended={})
    assert switches["a"].spans(0, 6) == [(0, 0, 3), (1, 3, 3)]
    assert switches["a"].spans(1, 6) == [(0, 0, 4), (1, 4, 2)]
    assert switches["b"].spans(0, 2) == [(1, 0, 2)]  # not begun: all the new version's
    assert switches["c"].spans(0, 5) == [(0, 0, 5)]


def test_under_a_pause_a_finished_child_the_output_processor_no_longer_holds_keeps_its_tokens_old():
    points = SwitchPoints(0, 2)
    points.produced[1] = 7  # child 1 ended (and left the output processor), child 0 goes on
    switch_all({"a": points}, {"a": {0: 9}}, 1)
    assert points.spans(1, 7) == [(0, 0, 7)]
    assert points.spans(0, 12) == [(0, 0, 9), (1, 9, 3)]


def test_a_completion_vllm_finished_is_passed_by_at_every_later_commit():
    points = SwitchPoints(0)
    switch_all({"a": points}, {"a": {0: 4}}, 1, ended={"a": {0}})  # finished at 4 tokens, none read yet
    switch_all({"a": points}, {}, 2, ended={})  # its count forgotten: it had ended, not "not begun"
    assert points.spans(0, 4) == [(0, 0, 4)]
