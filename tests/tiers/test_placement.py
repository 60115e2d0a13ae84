"""Where copies go and where a read looks first: pure functions, no cluster (DESIGN.md §13)."""

from __future__ import annotations

import itertools

import pytest

from ckptstore.errors import ConfigError
from ckptstore.tiers import TierConfig, check_node_name, node_name
from ckptstore.tiers.placement import STORE, read_order, replica_nodes

RING = ("n0", "n1", "n2", "n3")


def test_replicas_go_to_the_next_nodes_on_the_ring() -> None:
    assert replica_nodes(RING, "n0", 1) == ("n0",)
    assert replica_nodes(RING, "n0", 2) == ("n0", "n1")
    assert replica_nodes(RING, "n3", 3) == ("n3", "n0", "n1")


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_every_node_receives_as_many_copies_as_it_sends_and_any_r_minus_1_losses_leave_one(
    replicas: int,
) -> None:
    placed = {me: replica_nodes(RING, me, replicas) for me in RING}
    received = {node: sum(node in nodes for nodes in placed.values()) for node in RING}
    assert set(received.values()) == {replicas}
    for lost in itertools.combinations(RING, replicas - 1):
        for me, nodes in placed.items():
            assert set(nodes) - set(lost), f"{me}'s blobs are gone with {lost}"


def test_replicas_need_as_many_nodes_and_the_writer_among_them() -> None:
    with pytest.raises(ConfigError, match="between 1 and 4"):
        replica_nodes(RING, "n0", 5)
    with pytest.raises(ConfigError, match="not one of the job's nodes"):
        replica_nodes(RING, "x", 1)


def test_a_read_takes_its_own_copy_then_the_next_reachable_holders_then_the_store() -> None:
    assert read_order("n1", {"n0", "n1", "n3"}, RING, in_store=True) == ["n1", "n3", "n0", STORE]
    assert read_order("n1", {"n0", "n3"}, RING, in_store=False) == ["n3", "n0"]
    # An unreachable holder is left out; a blob no reachable node holds comes from the store.
    assert read_order("n1", {"n2"}, {"n0", "n1"}, in_store=True) == [STORE]
    assert read_order("n1", {"n2"}, {"n0", "n1"}, in_store=False) == []


def test_tier_config_checks_every_field_and_names_it() -> None:
    with pytest.raises(ConfigError, match=r"only one it may contain is \{node\}"):
        TierConfig(local_dir="/tmp/{rank}")
    with pytest.raises(ConfigError, match="local_dir"):
        TierConfig(local_dir="/tmp/{node")
    with pytest.raises(ConfigError, match="replicas"):
        TierConfig(local_dir="/tmp/t", replicas=-1)
    with pytest.raises(ConfigError, match="keep_last"):
        TierConfig(local_dir="/tmp/t", keep_last=0)
    with pytest.raises(ConfigError, match="names a node twice"):
        TierConfig(local_dir="/tmp/t", nodes=("a", "a"))
    with pytest.raises(ConfigError, match=r"invalid TierConfig\.node"):
        TierConfig(local_dir="/tmp/t", node="../etc")
    cfg = TierConfig(local_dir="/tmp/t-{node}", node="b", nodes=("a", "c"))
    assert cfg.ring() == ("a", "b", "c")
    assert cfg.replica_count() == 2  # the default where the job has two nodes or more
    assert str(cfg.root("c")) == "/tmp/t-c"
    assert TierConfig(local_dir="/tmp/t", node="solo").replica_count() == 1
    with pytest.raises(ConfigError, match="needs 3 nodes, but the job has 2"):
        TierConfig(local_dir="/tmp/t", node="a", nodes=("b",), replicas=3).replica_count()


def test_node_names_come_from_the_environment_or_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTSTORE_NODE", "gpu-07")
    assert node_name() == "gpu-07"
    monkeypatch.setenv("CKPTSTORE_NODE", "a/b")
    with pytest.raises(ConfigError, match=r"\$CKPTSTORE_NODE"):
        node_name()
    monkeypatch.delenv("CKPTSTORE_NODE")
    assert check_node_name(node_name()) == node_name()
