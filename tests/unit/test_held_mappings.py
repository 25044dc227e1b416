"""HeldMappings' bookkeeping: what a holder keeps mapped, replaced and released (the opener is a
stand-in for cudaIpcOpenMemHandle; the GPU test holds real trainer memory)."""

from __future__ import annotations

import pytest
import torch

from rlsync.transfer.held import HeldMappings


class Opener:
    def __init__(self, refuse: bytes = b""):
        self.opened: list[bytes] = []
        self.refuse = refuse

    def __call__(self, handle: bytes, device) -> torch.Tensor:
        if handle == self.refuse:
            raise RuntimeError(f"cannot open {handle!r}")
        self.opened.append(handle)
        return torch.full((4,), len(self.opened), dtype=torch.uint8)


def test_a_hold_maps_each_storage_once_and_replaces_what_the_holder_held():
    opener = Opener()
    held = HeldMappings(opener)
    assert held.hold("trainer", [b"a", b"b", b"a"], torch.device("cpu")) == 2
    a = held.get(b"a")
    assert a is not None and held.count() == 2
    # The next onload: "a" stays as it was (no second open), "b" is let go, "c" is new.
    assert held.hold("trainer", [b"a", b"c"], torch.device("cpu")) == 1
    assert opener.opened == [b"a", b"b", b"c"]
    assert held.get(b"a") is a and held.get(b"b") is None and held.count() == 2


def test_holders_are_apart_and_a_release_closes_only_its_own():
    held = HeldMappings(Opener())
    held.hold("one", [b"a"], torch.device("cpu"))
    held.hold("two", [b"b"], torch.device("cpu"))
    assert held.release("one") == 1 and held.release("one") == 0
    assert held.get(b"a") is None and held.get(b"b") is not None


def test_a_handle_that_does_not_open_leaves_the_holders_set_as_it_was():
    held = HeldMappings(Opener(refuse=b"bad"))
    held.hold("trainer", [b"a"], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="cannot open"):
        held.hold("trainer", [b"c", b"bad"], torch.device("cpu"))
    assert held.get(b"a") is not None and held.get(b"c") is None


def test_a_memo_lives_exactly_as_long_as_its_holder_keeps_the_same_list_of_storages():
    held = HeldMappings(Opener())
    cpu = torch.device("cpu")
    assert held.memo((b"a",)) is None, "nothing held: nothing to remember views of"
    held.hold("trainer", [b"a", b"b"], cpu)
    memo = held.memo((b"a", b"b"))
    memo["views"] = [held.get(b"a")[:2]]
    assert held.memo((b"b",)) is memo and held.memo((b"a", b"z")) is None
    held.hold("trainer", [b"a", b"b"], cpu)  # the same list again: what was derived from it holds
    assert held.memo((b"a", b"b")) is memo
    held.hold("trainer", [b"b", b"a"], cpu)  # another order: what was derived by position goes
    assert held.memo((b"a", b"b")) == {} and held.get(b"a") is memo["views"][0]._base
    held.hold("trainer", [b"a"], cpu)  # "b" closes: views cut from the old set go with it
    assert held.memo((b"a",)) == {}
    held.memo((b"a",))["views"] = []
    held.release("trainer")
    assert held.memo((b"a",)) is None
    held.hold("trainer", [b"a"], cpu)
    assert held.memo((b"a",)) == {}, "a new hold starts with nothing remembered"


def test_a_pull_of_exactly_a_holders_list_finds_its_mappings_and_memo_in_one_comparison():
    opener = Opener()
    held = HeldMappings(opener)
    assert held.hold("trainer", [b"a", b"b", b"a"], torch.device("cpu")) == 2
    assert held.hold("trainer", [b"a", b"b", b"a"], torch.device("cpu")) == 0, "the same list again: nothing to do"
    tensors, memo = held.lookup([b"a", b"b", b"a"])
    assert [t is held.get(h) for t, h in zip(tensors, [b"a", b"b", b"a"])] == [True] * 3
    assert memo is held.memo((b"a", b"b"))
    assert held.lookup([b"b", b"a"]) is None and held.get_all([b"b", b"a"]) == [held.get(b"b"), held.get(b"a")]
    assert held.get_all([b"a", b"z"]) is None
    held.release("trainer")
    assert held.lookup([b"a", b"b", b"a"]) is None and opener.opened == [b"a", b"b"]


def test_mapped_answers_a_repeat_of_the_same_handles_at_once_until_a_hold_or_release_comes_between():
    held = HeldMappings(Opener())
    held.hold("trainer", [b"a", b"b"], torch.device("cpu"))
    handles = (b"b", b"a")
    mappings, memo = held.mapped(handles)
    assert mappings == [held.get(b"b"), held.get(b"a")] and memo is held.memo(handles)
    assert held.mapped(handles)[0] is mappings, "the same tuple again: the kept answer"
    assert held.mapped((b"a", b"z")) is None, "one not held: no answer"
    held.hold("other", [b"c"], torch.device("cpu"))
    again = held.mapped(handles)
    assert again is not None and again[0] is not mappings and again[0] == mappings, "a hold between: looked up anew"
    import weakref
    gone = weakref.ref(again[0][0])
    held.release("trainer")
    del again, mappings, memo
    assert gone() is None, "released: mapped() keeps no mapping open"
    assert held.mapped(handles) is None, "released: nothing mapped to answer with"
