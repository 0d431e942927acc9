"""What the node offers (its memory, a container's limit, its links' speed) and the node
budget's defaults sized from it: buffers a share of the memory, requests in flight what fills
the link at the throughput a connection was measured to carry."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloudshards.source import adapt, budget, machine

GIB = 1 << 30


def _write(root: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


MEMINFO = "MemTotal:       65536000 kB\nMemFree:         1000 kB\n"  # 62.5 GiB


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {
                "proc/self/cgroup": "0::/user.slice\n",
                "sys/fs/cgroup/user.slice/memory.max": "max\n",
                # cgroup v1's "no limit" is a page-rounded 2**63
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            },
            65536000 * 1024,
            id="the-machines-without-a-limit",
        ),
        pytest.param(
            {
                "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
                "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": str(8 * GIB),
            },
            8 * GIB,
            id="a-cgroup-v2-limit-where-lower",
        ),
        pytest.param(
            {
                "proc/self/cgroup": "5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n",
                "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(16 * GIB),
            },
            16 * GIB,
            id="a-cgroup-v1-limit-where-lower",
        ),
        pytest.param(
            {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": str(4 * GIB)},
            4 * GIB,
            id="a-container-namespaces-limit-at-the-mount-root",
        ),
    ],
)
def test_memory_is_the_lowest_of_the_machine_and_its_cgroup_limits(
    tmp_path: Path, files: dict[str, str], expected: int
) -> None:
    root = _write(tmp_path, {"proc/meminfo": MEMINFO, **files})
    assert machine.memory_bytes(root) == expected


def test_memory_unknown_is_none_and_damaged_files_are_skipped(tmp_path: Path) -> None:
    assert machine.memory_bytes(str(tmp_path)) is None
    root = _write(
        tmp_path,
        {
            "proc/meminfo": "MemTotal: lots\n",
            "proc/self/cgroup": "garbage\n",
            "sys/fs/cgroup/memory.max": "-1\n",
        },
    )
    assert machine.memory_bytes(root) is None


def _interface(name: str, speed: str, state: str = "up", device: bool = True) -> dict[str, str]:
    files = {f"sys/class/net/{name}/speed": speed, f"sys/class/net/{name}/operstate": state}
    if device:
        files[f"sys/class/net/{name}/device/vendor"] = "0x1d0f\n"
    return files


def test_link_speed_is_the_fastest_device_that_is_up(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            **_interface("lo", "100000\n", "unknown", device=False),  # carries no store's bytes
            **_interface("eth0", "25000\n"),
            **_interface("eth1", "100000\n", "down"),  # not cabled
            **_interface("ens5", "-1\n"),  # a virtual NIC without a speed
            **_interface("docker0", "40000\n", device=False),  # a bridge
        },
    )
    assert machine.link_bytes_per_s(root) == 25_000 * 125_000  # 25 Gbit/s


def test_link_speed_unknown_is_none(tmp_path: Path) -> None:
    assert machine.link_bytes_per_s(str(tmp_path)) is None
    assert machine.link_bytes_per_s(_write(tmp_path / "a", _interface("ens5", "-1\n"))) is None
    # A container's veth reports 10 Gbit/s whatever the host's NIC: it has no device.
    veth = _interface("eth0", "10000\n", device=False)
    assert machine.link_bytes_per_s(_write(tmp_path / "b", veth)) is None


@pytest.mark.parametrize(
    ("memory", "expected"),
    [
        (None, 4 * GIB),
        (1024 * GIB, 4 * GIB),  # a training host: the most
        (64 * GIB, 4 * GIB),
        (16 * GIB, 1 * GIB),  # a container: a sixteenth of its limit
        (2 * GIB, 256 << 20),  # never below the least
    ],
)
def test_buffer_budget_is_a_share_of_the_memory(memory: int | None, expected: int) -> None:
    assert budget.default_buffer_bytes(memory) == expected


@pytest.mark.parametrize(
    ("gbps", "connection", "expected"),
    [
        (100, None, 218),  # 12.5 GB/s at the nominal 72 MB/s a request, a quarter over
        (25, None, 55),
        (25, 18e6, 218),  # slow connections: more of them fill the link
        (400, 18e6, 1024),  # at most
        (10, 1e9, 32),  # a fast (local) store: at least
    ],
)
def test_requests_fill_the_link_at_the_measured_connection_rate(
    gbps: int, connection: float | None, expected: int
) -> None:
    assert budget.requests_for_link(gbps * 125_000_000, connection) == expected


def test_the_node_budget_follows_the_link_and_the_measured_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CLOUDSHARDS_NODE_REQUESTS", raising=False)
    monkeypatch.delenv("CLOUDSHARDS_NODE_BUFFER_BYTES", raising=False)
    monkeypatch.setattr(machine, "link_bytes_per_s", lambda: 25 * 125_000_000)
    monkeypatch.setattr(machine, "memory_bytes", lambda: 16 * GIB)
    budget.forget()
    adapt.forget()
    try:
        node = budget.node_budget()
        assert node.buffer_bytes == 1 * GIB
        assert node.slots == budget.MAX_NODE_REQUESTS
        assert node.limit() == node.ceiling() == 55  # nothing measured: the nominal rate
        for _ in range(20):  # a link whose connections carry 25 MB/s after 30 ms
            adapt.record("s3://bucket/a.tar", 64 << 10, 0.03)
            adapt.record("s3://bucket/a.tar", 4 << 20, 0.03 + (4 << 20) / 25e6)
        # 80 ms parts take 110 ms: 18.2 MB/s a request, 172 fill 25 Gbit/s, a quarter more
        assert node.ceiling() == pytest.approx(215, abs=3)
        node.back_off(0.01)  # a throttling halves what is in use now
        assert node.limit() == node.ceiling() // 2
    finally:
        budget.forget()
        adapt.forget()


def test_settings_win_over_what_the_node_offers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDSHARDS_NODE_REQUESTS", "16")
    monkeypatch.setenv("CLOUDSHARDS_NODE_BUFFER_BYTES", str(100 << 20))
    monkeypatch.setattr(machine, "link_bytes_per_s", lambda: 400 * 125_000_000)
    monkeypatch.setattr(machine, "memory_bytes", lambda: 16 * GIB)
    budget.forget()
    try:
        node = budget.node_budget()
        assert (node.slots, node.ceiling(), node.buffer_bytes) == (16, 16, 100 << 20)
    finally:
        budget.forget()


def test_an_unknown_link_keeps_the_fixed_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLOUDSHARDS_NODE_REQUESTS", raising=False)
    monkeypatch.setattr(machine, "link_bytes_per_s", lambda: None)
    budget.forget()
    adapt.forget()
    try:
        adapt.record("s3://bucket/a.tar", 64 << 10, 0.03)
        adapt.record("s3://bucket/a.tar", 4 << 20, 0.2)
        node = budget.node_budget()
        assert node.slots == node.ceiling() == budget.DEFAULT_NODE_REQUESTS
    finally:
        budget.forget()
        adapt.forget()
