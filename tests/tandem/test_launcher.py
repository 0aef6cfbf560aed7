"""`tandem serve` argument handling and supervision policy, without processes."""

from __future__ import annotations

import argparse
import itertools
import os

import pytest

from tandem.launcher import Child, Cluster, _on_port, _without, gpu_placement
from tandem.supervisor import GiveUpError, RestartPolicy, Supervisor


def _args(device: str, util: float = 0.9) -> argparse.Namespace:
    return argparse.Namespace(device=device, gpu_memory_utilization=util)


def _util(k: int, m: int) -> list[str]:
    return ["--gpu-memory-utilization", f"{0.9 * k / m:.4f}"]


def test_services_on_one_gpu_split_its_memory_cumulatively():
    shares = gpu_placement(_args("cuda"), ["m", "--device", "cuda"], 3, num_gpus=1)
    assert shares == [_util(k, 3) for k in (1, 2, 3)]


def test_services_spread_over_gpus_in_start_order_and_split_each_gpu():
    # 1 prefill + 1 decode on two GPUs: one each, the whole of it
    assert gpu_placement(_args("cuda"), [], 2, num_gpus=2) == [
        ["--device", "cuda:0"],
        ["--device", "cuda:1"],
    ]
    # 2 prefills + 2 decodes on two GPUs: a prefill and a decode share each
    shares = gpu_placement(_args("cuda"), [], 4, num_gpus=2)
    assert shares == [
        ["--device", "cuda:0", *_util(1, 2)],
        ["--device", "cuda:1", *_util(1, 2)],
        ["--device", "cuda:0", *_util(2, 2)],
        ["--device", "cuda:1", *_util(2, 2)],
    ]
    # more GPUs than services: one service per GPU, the rest idle
    assert gpu_placement(_args("cuda"), [], 1, num_gpus=8) == [[]]


def test_no_split_on_cpu_or_when_sized_explicitly():
    assert gpu_placement(_args("cpu"), [], 2) == [[], []]
    argv = ["--device", "cuda", "--kv-cache-memory-bytes", "1000"]
    assert gpu_placement(_args("cuda"), argv, 2, num_gpus=1) == [[], []]
    argv = ["--device", "cuda", "--gpu-memory-utilization=0.5"]
    assert gpu_placement(_args("cuda", 0.5), argv, 2, num_gpus=1) == [[], []]
    # a GPU named by the user is theirs to choose: nothing is spread
    assert gpu_placement(_args("cuda:1"), [], 2, num_gpus=2) == [[], []]


def test_pin_gpu_puts_the_named_gpu_first_and_keeps_the_others_visible(monkeypatch):
    from engine.service_main import pin_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert pin_gpu("cuda:1") == "cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,4,6"
    assert pin_gpu("cpu") == "cpu" and pin_gpu("cuda") == "cuda"
    with pytest.raises(ValueError, match="no such GPU"):
        pin_gpu("cuda:7")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert pin_gpu("cuda:1") == "cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"].startswith("1,0,2,3,")


def test_serve_only_flags_are_not_passed_to_services():
    argv = ["model", "--port", "9000", "--num-decode=2", "--max-model-len", "512"]
    assert _without(argv, {"--port": 0, "--num-decode": 0}) == ["model", "--max-model-len", "512"]


# ---- supervision ---------------------------------------------------------------------------
class FakeProc:
    _pids = itertools.count(100)

    def __init__(self):
        self.pid = next(self._pids)
        self.returncode = None

    def poll(self):
        return self.returncode

    def kill(self):
        self.returncode = -9

    def wait(self, timeout=None):
        return self.returncode


class FakeCluster:
    """`spawn` as `Cluster` does it, with processes the test ends and readies by hand."""

    def __init__(self):
        self.spawned: list[Child] = []

    def spawn(self, role, argv, replaces=None) -> Child:
        child = Child(role, FakeProc(), argv=list(argv))
        self.spawned.append(child)
        return child


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ready(child: Child, address: str = "127.0.0.1:5000") -> Child:
    child.address = address
    child.ready.set()
    return child


def _die(child: Child, code: int) -> None:
    child.proc.returncode = code
    child.ready.set()  # the output pipe ended


def _supervised(policy: RestartPolicy | None = None):
    cluster, clock = FakeCluster(), Clock()
    sup = Supervisor(cluster, policy or RestartPolicy(), clock)
    first = _ready(cluster.spawn("decode", ["m"]))
    sup.watch(first, _on_port(["m"], first.address))
    return sup, cluster, clock, first


def test_a_crashed_child_is_restarted_on_its_port_with_doubling_backoff(caplog):
    sup, cluster, clock, child = _supervised()
    delays = []
    for _ in range(7):
        _die(child, -9)
        sup.tick()
        n = len(cluster.spawned)
        start = clock.now
        while len(cluster.spawned) == n:  # not respawned before its backoff
            clock.now += 0.5
            sup.tick()
        delays.append(clock.now - start)
        child = cluster.spawned[-1]
        assert child.argv == ["m", "--port", "5000"]
        _ready(child)
        sup.tick()
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert "decode (pid 100) exited with code -9 (SIGKILL); restarting it in 1 s" in caplog.text


def test_backoff_starts_over_after_a_child_stayed_up():
    sup, cluster, clock, child = _supervised(RestartPolicy(stable_s=60.0))
    for _ in range(3):  # crash loop: backoff 1, 2, 4 -> next 8
        _die(child, 1)
        sup.tick()
        clock.now += 30.0
        sup.tick()
        child = _ready(cluster.spawned[-1])
        sup.tick()
    assert sup.slots[0].backoff_s == 8.0
    clock.now += 61.0
    _die(child, 1)
    sup.tick()
    assert sup.slots[0].restart_at == clock.now + 1.0


def test_give_up_after_consecutive_start_up_failures():
    sup, cluster, clock, child = _supervised(RestartPolicy(max_start_failures=3))
    _die(child, -9)  # was up: not a start-up failure
    sup.tick()
    for i in range(3):
        clock.now += 60.0
        sup.tick()  # respawn
        _die(cluster.spawned[-1], 1)  # exits before READY
        if i < 2:
            sup.tick()
        else:
            with pytest.raises(GiveUpError, match="decode failed at start-up 3 times"):
                sup.tick()


def test_a_ready_restart_resets_the_start_up_failure_count():
    sup, cluster, clock, child = _supervised(RestartPolicy(max_start_failures=2))
    _die(child, -9)
    sup.tick()
    clock.now += 60.0
    sup.tick()
    _die(cluster.spawned[-1], 1)  # one start-up failure
    sup.tick()
    clock.now += 60.0
    sup.tick()
    _ready(cluster.spawned[-1])
    sup.tick()
    assert sup.slots[0].num_start_failures == 0


def test_a_restart_that_never_gets_ready_is_killed_and_counted():
    sup, cluster, clock, child = _supervised(RestartPolicy(start_timeout_s=100.0))
    _die(child, -9)
    sup.tick()
    clock.now += 1.0
    sup.tick()
    hung = cluster.spawned[-1]
    clock.now += 101.0
    sup.tick()
    assert hung.proc.returncode == -9 and sup.slots[0].num_start_failures == 1


def test_a_child_that_dies_before_ready_is_reported_with_its_last_output(monkeypatch):
    """Without the log forwarded (as the integration tests run a cluster), the error itself
    carries what the child said: here, its refusal to start without the internal token."""
    for name in ("TANDEM_INTERNAL_TOKEN", "TANDEM_INTERNAL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError) as failure:
        Cluster(log_prefix=False).start("prefill", ["/nonexistent/model-dir"], timeout_s=120)
    message = str(failure.value)
    assert message.startswith("prefill exited with code 1 before becoming ready; its last output:")
    assert "internal gRPC would be unauthenticated" in message
