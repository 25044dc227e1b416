"""Every public RPC of a real replica and a real trainer (separate processes) gets requests with
random field values (hypothesis, built from the protobuf descriptors): each answer is OK or a precise
status, never INTERNAL or UNKNOWN (what an unhandled exception in a servicer becomes), and the
services are still up and serving afterwards."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import rollout_args
from rlsync.client import RolloutClient, TrainerClient
from rlsync.rollout.v1 import rollout_pb2
from rlsync.rollout.v1.rollout_pb2_grpc import RolloutServiceStub
from rlsync.trainer.v1 import trainer_pb2
from rlsync.trainer.v1.trainer_pb2_grpc import TrainerServiceStub

CRASHES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
_T = FieldDescriptor
INTS = st.sampled_from([0, 1, -1, 2, 7, 255, 2**31 - 1, -2**31])
FLOATS = st.sampled_from([0.0, 1.0, -1.0, 0.5, 1e30, -1e30, math.inf, -math.inf, math.nan])
SCALARS = {
    _T.TYPE_BOOL: st.booleans(), _T.TYPE_STRING: st.text(max_size=12), _T.TYPE_BYTES: st.binary(max_size=48),
    _T.TYPE_DOUBLE: FLOATS, _T.TYPE_FLOAT: FLOATS,
    **{t: INTS for t in (_T.TYPE_INT32, _T.TYPE_SINT32, _T.TYPE_SFIXED32)},
    **{t: INTS | st.sampled_from([2**63 - 1, -2**63]) for t in (_T.TYPE_INT64, _T.TYPE_SINT64, _T.TYPE_SFIXED64)},
    **{t: st.sampled_from([0, 1, 2, 7, 2**32 - 1]) for t in (_T.TYPE_UINT32, _T.TYPE_FIXED32)},
    **{t: st.sampled_from([0, 1, 2, 7, 2**64 - 1]) for t in (_T.TYPE_UINT64, _T.TYPE_FIXED64)},
}


def messages(descriptor, depth: int = 0, overrides: dict | None = None) -> st.SearchStrategy:
    """Messages of `descriptor` with a random subset of fields set to random (often hostile) values;
    `overrides`: field name -> strategy, for top-level fields."""
    fields = {}
    for f in descriptor.fields:
        if overrides and f.name in overrides:
            value = overrides[f.name]
        elif f.type == _T.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
            key, item = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            if item.type not in SCALARS:
                continue
            fields[f.name] = st.dictionaries(SCALARS[key.type], SCALARS[item.type], max_size=3)
            continue
        elif f.type == _T.TYPE_MESSAGE:
            if depth >= 2:
                continue
            value = messages(f.message_type, depth + 1)
        elif f.type == _T.TYPE_ENUM:
            value = st.sampled_from([v.number for v in f.enum_type.values] + [99, -1])
        else:
            value = SCALARS[f.type]
        fields[f.name] = st.lists(value, max_size=3) if f.is_repeated else value
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: _build(descriptor, kw))


def _build(descriptor, kw: dict):
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(descriptor)()
    for name, value in kw.items():
        field = getattr(msg, name)
        if isinstance(value, dict):  # a map field
            field.update(value)
        elif isinstance(value, list):
            for item in value:
                field.add().CopyFrom(item) if hasattr(field, "add") else field.append(item)
        elif hasattr(value, "SerializeToString"):
            field.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-checkpoints")


@pytest.fixture(scope="module")
def targets(module_services):
    rollout = module_services.start("rollout", rollout_args("hf"), name="fuzz-rollout")
    trainer = module_services.start("trainer", [], name="fuzz-trainer")
    yield {"rollout": (rollout.address, RolloutServiceStub, rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]),
           "trainer": (trainer.address, TrainerServiceStub, trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"])}


CASES = [("rollout", m.name) for m in rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods] + \
        [("trainer", m.name) for m in trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].methods]


@pytest.mark.parametrize("service, method", CASES, ids=[f"{s}.{m}" for s, m in CASES])
def test_random_requests_get_precise_statuses(targets, scratch, service, method):
    address, stub_class, desc = targets[service]
    # Checkpoint paths stay inside a scratch folder (random names, NUL bytes included), never the cwd.
    names = st.text(st.characters(codec="utf-8", exclude_characters="/."), max_size=12)
    inside = names.map(lambda name: str(scratch / name))
    overrides = {"path": inside} if method in ("SaveCheckpoint", "LoadCheckpoint") else None
    spec = desc.methods_by_name[method]
    channel = grpc.insecure_channel(address)
    call = getattr(stub_class(channel), method)

    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(messages(spec.input_type, overrides=overrides))
    def check(request):
        try:
            reply = call(request, timeout=20)
            if spec.server_streaming:
                for _ in reply:
                    pass
        except grpc.RpcError as e:
            assert e.code() not in CRASHES, f"{method}({request}) -> {e.code().name}: {e.details()}"
            assert e.details(), f"{method}({request}) -> {e.code().name} with no message"

    try:
        check()
    finally:
        channel.close()
        _heal(targets)


def _heal(targets) -> None:
    """Whatever the random calls did (paused, put to sleep, half-prepared), the services answer and
    the replica serves again."""
    replica = RolloutClient(targets["rollout"][0])
    replica.abort_update()
    replica.wake_up()
    replica.resume()
    assert replica.info().state == 1
    assert TrainerClient(targets["trainer"][0]).state().model
