"""Rollout process lifecycle: shutdown on SIGTERM, access control, TLS, refused arguments, real sleep."""

from __future__ import annotations

import signal
import time
import subprocess

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import NEEDS_SGLANG, engines, rollout_args
from rlsync.client import RolloutClient, RpcError
from streams import frozen_streams


@pytest.mark.parametrize("engine", engines("hf", "vllm", "sglang"))
def test_sigterm_ends_streams_with_reason_and_leaves_no_process(services, engine):
    """rlsync's own shutdown runs, whatever handler the engine installed while starting (SGLang's)."""
    proc = services.start("rollout", rollout_args(engine), name=f"sigterm-{engine}")
    family = psutil.Process(proc.proc.pid).children(recursive=True)
    if engine != "hf":
        assert family, f"{engine} runs its engine in child processes"
    client = RolloutClient(proc.address)
    (stream,) = frozen_streams(client, ["long"], max_tokens=900, ignore_eos=True)  # open when the signal comes
    proc.proc.send_signal(signal.SIGTERM)
    stream.thread.join(30)
    final = stream.chunks[-1]
    assert final.finish_reason == 3 and "shutting down" in final.finish_detail
    assert proc.proc.wait(60) == 0
    gone, alive = psutil.wait_procs(family, timeout=15)
    assert not alive, f"processes left behind: {alive}"


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_token_is_required_except_for_health(services):
    proc = services.start("rollout", rollout_args("hf", "--token", "s3cret"), name="auth")
    for token, fragment in (("", "missing"), ("wrong", "wrong token")):
        with pytest.raises(RpcError) as e:
            RolloutClient(proc.address, token=token).info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and fragment in e.value.message
        with pytest.raises(RpcError) as e:  # streaming RPCs are guarded too
            RolloutClient(proc.address, token=token).complete("hi", max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    ok = RolloutClient(proc.address, token="s3cret")
    assert ok.info().engine == "hf"
    assert ok.complete("hi", max_tokens=2, ignore_eos=True)[0].finish_reason == "length"
    assert _health(proc.address) == health_pb2.HealthCheckResponse.SERVING


def test_tls_from_cert_files(services, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    proc = services.start("rollout", rollout_args("hf", "--tls-cert", str(cert), "--tls-key", str(key),
                                                  "--token", "t"), name="tls")
    client = RolloutClient(proc.address, token="t", tls=True, tls_ca=str(cert))
    assert client.info().engine == "hf"
    with pytest.raises(RpcError):
        RolloutClient(proc.address, token="t", timeout=3).info()  # plaintext client cannot talk to it


@pytest.mark.parametrize("engine, args, fragment", [
    ("hf", ["--engine-args", '{"bogus": 1}'], "bogus"),
    ("hf", ["--engine-args", '{"max_prefill_tokens": 0}'], "max_prefill_tokens must be >= 1"),
    ("vllm", ["-E", "bogus_flag=1"], "bogus_flag"),
    ("vllm", ["-E", "tensor_parallel_size=0"], "tensor_parallel_size"),
    pytest.param("sglang", ["-E", "tp_size=2"], "runs one rank (tp_size=2 asked)",  # SGLang's CPU TP needs AMX kernels
                 marks=[NEEDS_SGLANG, pytest.mark.sglang]),
])
def test_wrong_engine_argument_is_refused_at_start(services, engine, args, fragment):
    """Started as every replica of the tests is (forked from the session's preloaded image that holds the
    engine, as rlsync.preload says; SGLang in its own Python), it exits 2 before it listens, saying why."""
    proc = services.start("rollout", ["--engine", engine, *args], wait=False, name=f"refused-{engine}")
    assert proc.proc.wait(180) == 2, proc.log_tail()
    said = proc.log_path.read_text(errors="replace")
    assert "rlsync rollout: error:" in said, said[-2000:]
    assert fragment in said[said.index("rlsync rollout: error:"):]
    assert '"listening"' not in said


def test_hf_sleep_frees_memory_and_wake_up_restores_output(services, small_model):
    proc = services.start("rollout", ["--engine", "hf", "--model", str(small_model)], name="hf-sleep")
    client = RolloutClient(proc.address)
    before = client.complete("memory", max_tokens=16, temperature=0, ignore_eos=True)[0]
    awake = client.info().memory
    rss_awake = psutil.Process(proc.proc.pid).memory_info().rss
    assert awake.weights_bytes > 50e6

    asleep = client.sleep(level=2).memory
    rss_asleep = psutil.Process(proc.proc.pid).memory_info().rss
    assert asleep.weights_bytes == 0 and asleep.kv_cache_bytes == 0
    assert rss_awake - rss_asleep > 0.8 * awake.weights_bytes, (rss_awake, rss_asleep)

    woke = client.wake_up().memory
    assert woke.weights_bytes == awake.weights_bytes
    after = client.complete("memory", max_tokens=16, temperature=0, ignore_eos=True)[0]
    assert after.token_ids == before.token_ids


def test_a_dead_vllm_engine_says_why_and_leaves_the_rotation(services):
    """A worker killed by a fatal signal: the replica stays up to say which process died of which
    signal and where its log is, reports NOT_SERVING, and the coordinator stops routing to it."""
    from rlsync.client import CoordinatorClient
    from rlsync.rollout.v1 import rollout_pb2

    co = services.start("coordinator", ["--sync-mode", "async"], name="co-dead")
    proc = services.start("rollout", rollout_args("vllm", "--coordinator", co.address), name="vllm-dead")
    client = RolloutClient(proc.address)
    with CoordinatorClient(co.address) as fleet:
        fleet.wait_ready(1)
        assert len(client.complete("hi", max_tokens=4, ignore_eos=True)[0].token_ids) == 4
        # The process that runs the model (where vLLM's AMX kernel died): the engine core, with one
        # worker (conftest: vLLM's uni executor); with several, each worker's own process.
        family = psutil.Process(proc.proc.pid).children(recursive=True)
        (worker,) = [p for p in family if "EngineCore" in p.name()]
        worker.send_signal(signal.SIGILL)

        with pytest.raises(RpcError) as e:
            client.complete("hi", max_tokens=4)
        assert e.value.code == grpc.StatusCode.INTERNAL
        assert f"pid {worker.pid} died of SIGILL" in e.value.message, e.value.message
        assert str(proc.log_path) in e.value.message

        info = client.info()
        assert info.state == rollout_pb2.SERVING_STATE_DEAD and "SIGILL" in info.dead_reason
        deadline = time.monotonic() + 10
        while _health(proc.address) != health_pb2.HealthCheckResponse.NOT_SERVING or fleet.status().members:
            assert time.monotonic() < deadline, "the dead replica should be NOT_SERVING and out of the fleet"
            time.sleep(0.1)
        assert "NOT_SERVING" in proc.why_down() and str(proc.log_path) in proc.why_down()
