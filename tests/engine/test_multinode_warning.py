"""Several nodes: gloo binds the address this host's name resolves to, unless GLOO_SOCKET_IFNAME
names an interface. With a default Ubuntu /etc/hosts that is 127.0.1.1 and no peer on another node
can connect; `init_distributed` warns at start when the ranks span nodes and it would happen."""

import warnings

import pytest
import torch.distributed as dist
from prorl.engine import distributed

TWO_NODES = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}  # torchrun --nnodes=2 --nproc_per_node=8


@pytest.mark.parametrize("address", ["127.0.1.1", "127.0.0.1", "::1"])
def test_ranks_across_nodes_on_a_loopback_hostname_are_warned(address):
    said = distributed.loopback_warning(TWO_NODES, resolve=lambda: address)
    assert f"loopback address {address}" in said and "8 of 16 on this one" in said
    assert "GLOO_SOCKET_IFNAME" in said and "NCCL_SOCKET_IFNAME" in said


@pytest.mark.parametrize(
    "env, address",
    [
        ({**TWO_NODES, "GLOO_SOCKET_IFNAME": "eth0"}, "127.0.1.1"),  # the interface is named
        (TWO_NODES, "10.1.2.3"),  # the hostname resolves to a routable address
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, "127.0.1.1"),  # one node
        ({"WORLD_SIZE": "2"}, "127.0.1.1"),  # not torchrun's environment: nothing to tell
    ],
)
def test_no_warning_when_gloo_can_connect(env, address):
    assert distributed.loopback_warning(env, resolve=lambda: address) is None


def test_init_distributed_warns_before_the_rendezvous(monkeypatch):
    """The warning comes before the rendezvous, where a run that cannot connect would wait."""
    for key, value in {**TWO_NODES, "RANK": "3", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(distributed, "hostname_address", lambda: "127.0.1.1")
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)

    def rendezvous(*args, **kwargs):
        raise ConnectionError("stopped at the rendezvous")

    monkeypatch.setattr(dist, "rendezvous", rendezvous)
    assert not dist.is_initialized()
    with pytest.warns(RuntimeWarning, match="loopback address 127.0.1.1"):
        with pytest.raises(ConnectionError):
            distributed.init_distributed()
    monkeypatch.setenv("LOCAL_RANK", "1")  # once per node: its local rank 0 says it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConnectionError):
            distributed.init_distributed()
