"""The hf engine's weight stores: an update is staged in the store the previous one retired
(double buffering), and that spare gives way to sleep, release and the batch's need for memory."""

from __future__ import annotations

import torch
from prometheus_client import REGISTRY

from rlsync.rollout.engines.hf_weights import Weights
from rlsync.transfer.manifest import Spec


def _weights() -> Weights:
    torch.manual_seed(0)
    return Weights(torch.nn.Linear(4, 3).requires_grad_(False), "", torch.device("cpu"))  # as the engine loads it


def test_an_update_is_staged_in_the_store_the_last_one_retired():
    w = _weights()
    first = w.store
    staged = w.staging()
    assert staged is not first, "no spare yet: a new store"
    staged.views["weight"].fill_(2.0)
    staged.views["bias"].fill_(3.0)
    w.swap(staged, version=1)
    assert w.store is staged and w.spare is first
    assert torch.equal(w.params["weight"].data, torch.full((3, 4), 2.0)), "the parameters point at the update"
    assert w.staging() is first and w.spare is None, "taken: the next update lands in it, and only that one"


def test_the_spare_goes_at_sleep_release_and_when_the_batch_needs_its_room():
    w = _weights()
    w.swap(w.staging(), version=1)
    w.yield_spare(free=100, need=100)
    assert w.spare is not None, "room enough beside it"
    w.yield_spare(free=99, need=100)
    assert w.spare is None, "generation comes first"
    w.swap(w.staging(), version=2)
    w.sleep(level=1)
    assert w.spare is None
    w.swap(w.staging(), version=3)
    w.release()
    assert w.spare is None and w.store is None


def test_staging_counts_a_store_unless_the_spare_is_kept_and_every_buffer_a_cast_needs():
    w = _weights()
    store = w.device_bytes()
    same = [Spec("weight", torch.float32, (3, 4), 48), Spec("bias", torch.float32, (3,), 12)]
    cast = [Spec("weight", torch.bfloat16, (3, 4), 24), Spec("bias", torch.float32, (3,), 12)]
    assert store == 60 and w.staging_bytes(same) == 60 and w.staging_bytes(cast) == 60 + 24
    w.swap(w.staging(), version=1)
    assert w.staging_bytes(same) == 0 and w.staging_bytes(cast) == 24


def test_a_mixture_of_experts_is_stored_under_its_checkpoints_names_and_wakes_from_its_checkpoint(tmp_path):
    """Fused experts span their experts' tensors in the store: an update (checkpoint names) lands in the
    fused parameters the model computes with, and Sleep(level=2) wakes from the checkpoint's files."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlsync.models import TinyMoeRecipe, build_tiny_moe

    path = build_tiny_moe(tmp_path / "moe", TinyMoeRecipe(num_hidden_layers=1, num_experts=4))
    weights = Weights.load(str(path), torch.device("cpu"), "float32")
    saved = load_file(path / "model.safetensors")
    assert set(weights.specs) == set(saved) == set(weights.checksums())
    fused = weights.model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    weights.store.views["model.layers.0.mlp.experts.3.up_proj.weight"].fill_(7.0)
    assert (fused[3, 32:] == 7.0).all() and not (fused[3, :32] == 7.0).any()
    weights.sleep(2)
    weights.wake_up()
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(weights.model(x).logits, AutoModelForCausalLM.from_pretrained(path)(x).logits)


class _Armed:
    """A stand-in for a copy armed into the spare (hf_armed.ArmedSpare's armed): what stopping it calls."""

    def __init__(self):
        self.disarmed = 0

    def disarm(self) -> None:
        self.disarmed += 1


def test_a_copy_armed_into_the_spare_runs_out_before_the_spare_goes_or_serves_again():
    """arm_while_generating keeps the spare in a copy armed behind the bell (ArmedSpare): taken by one thread
    only, counted as the spare's memory, and stopped (its copy run out) before anything else has the store: a
    disarm (sleep, hold, release, commit), or the batch's need for room."""
    from rlsync.rollout.engines.hf_armed import ArmedSpare, StepWatch

    w, watch = _weights(), StepWatch()
    w.swap(w.staging(), version=1)
    spare = w.take_spare()
    armed = _Armed()
    w.armed_spare = ArmedSpare(armed, spare, watch)
    watch.guard(armed)
    assert w.spare is None and w.spare_bytes() == spare.nbytes(), "armed, it is still the spare's memory"
    stopped = REGISTRY.get_sample_value("rlsync_replica_armed_copies_total", {"outcome": "stopped"}) or 0
    w.disarm()
    assert armed.disarmed == 1 and w.armed_spare is None and w.spare is spare, "run out, then the spare again"
    assert REGISTRY.get_sample_value("rlsync_replica_armed_copies_total", {"outcome": "stopped"}) == stopped + 1
    assert not watch.take(armed), "no longer guarded: the watch writes its bell no more"
    w.armed_spare = ArmedSpare(armed, w.take_spare(), watch)
    w.yield_spare(free=100, need=100)
    assert w.armed_spare is not None and armed.disarmed == 1, "room enough beside it"
    w.yield_spare(free=99, need=100)
    assert armed.disarmed == 2 and w.armed_spare is None and w.spare is None and w.spare_bytes() == 0
    w.armed_spare = ArmedSpare(armed, spare, watch)
    assert w.take_armed_spare().store is spare and w.take_armed_spare() is None, "one taker"


class _Bell:
    """A stand-in for a HostBell: the word the trainer's ring writes, as the CPU reads it (None: a bell in GPU
    memory, which the CPU cannot read)."""

    event_handle = b"event"

    def __init__(self, word: int | None):
        self.word = word

    def holds(self) -> int | None:
        return self.word


class _Adoptable(_Armed):
    """An armed copy that is the offer's (Armed.adopt would take it), behind `bell`."""

    nbytes, reads = 12, None

    def __init__(self, bell: _Bell):
        super().__init__()
        self.bell, self.adopted = bell, False

    def adopt(self, specs, offer) -> bool:
        self.adopted = True
        return True


def _counted(outcome: str) -> float:
    return REGISTRY.get_sample_value("rlsync_replica_armed_copies_total", {"outcome": outcome}) or 0


def test_a_copy_armed_beside_generation_is_adopted_only_once_the_trainers_bell_reached_it():
    """Adopted, a copy is guarded no more: one the trainer's bell had not started yet would hold up a launch that
    waits for the whole device until the trainer's write lands (or for good, were the trainer gone). So a prepare
    waits a little (RING_WAIT, the watch guarding meanwhile) for the bell to hold its offer's value, and takes the
    copy only then; another is disarmed (it runs out into the spare, counted `late`) and the update copies as it
    prepares."""
    import asyncio
    import threading

    from rlsync.rollout.engines.hf_armed import CANCELLED, RING_WAIT, Arming, ArmedSpare, StepWatch
    from rlsync.transfer.v1 import transfer_pb2 as pb

    w, watch, arming = _weights(), StepWatch(), Arming(torch.device("cpu"))
    w.swap(w.staging(), version=1)
    spare = w.take_spare()
    offer = pb.Offer()
    offer.mapped.bell = 7
    # not written; an older offer's value; let go; this offer's; written 5 ms into the wait; a bell in GPU memory
    for word, late, taken in ((0, None, False), (6, None, False), (CANCELLED, None, False), (7, None, True),
                              (0, 7, True), (None, None, True)):
        bell = _Bell(word)
        armed = _Adoptable(bell)
        watch.guard(armed)
        w.armed_spare = ArmedSpare(armed, spare, watch)
        before = _counted("late")
        if late is not None:
            threading.Timer(0.005, setattr, (bell, "word", late)).start()
        got = asyncio.run(arming.adopt_spare(w, [], offer, version=2))
        assert (got is not None) == taken and armed.adopted == taken, word
        assert w.armed_spare is None and not watch.take(armed), "taken from the watch either way"
        if taken:
            assert got[0] is spare and got[1].report.nbytes == 12 and armed.disarmed == 0
            spare = w.take_spare() or spare
        else:
            assert armed.disarmed == 1 and w.take_spare() is spare, "run out, and the spare again"
            assert _counted("late") == before + 1, word
    assert RING_WAIT <= 0.05, "a prepare waits little for a bell"
