""":func:`kvpersist.serving.launcher.vllm_client.free_port`: a port below the ephemeral range, where no
outgoing connection's source port can take it before the caller's server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvpersist.serving.launcher import vllm_client


def test_a_port_below_the_ephemeral_range_that_binds() -> None:
    low, _ = vllm_client.ephemeral_ports()
    ports = {vllm_client.free_port() for _ in range(20)}
    assert all(vllm_client.PORTS_FROM <= p < low for p in ports)
    assert len(ports) > 1  # picked at random, not one fixed port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_a_range_that_starts_low_falls_back_to_the_kernel_s_pick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "ip_local_port_range"
    fake.write_text("1024\t65000\n")
    monkeypatch.setattr(vllm_client, "EPHEMERAL_RANGE", fake)
    assert vllm_client.ephemeral_ports() == (1024, 65000)
    assert 1024 <= vllm_client.free_port() <= 65535
