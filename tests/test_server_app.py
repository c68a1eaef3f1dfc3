"""The ServerApp's setup checks: every node must number classes and run the teacher as the server expects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, RecordDict

from feddifrc_app.server_app import check_classes, check_teachers


def _setup(**infos: dict) -> tuple[dict[int, RecordDict], SimpleNamespace]:
    """Setup replies keyed by node id (100 + partition id) and the node -> partition map."""
    setup = {100 + int(p[1:]): RecordDict({"info": ConfigRecord(info)}) for p, info in infos.items()}
    return setup, SimpleNamespace(partition_of={n: n - 100 for n in setup})


def test_nodes_with_one_teacher_pass_and_mixed_weights_name_each_partition() -> None:
    same, fed = _setup(p0={"teacher-weights": "a" * 64}, p1={"teacher-weights": "a" * 64})
    check_teachers(same, fed)
    check_teachers(*_setup(p0={}, p1={}))  # FedAvg: no teacher at all
    mixed, fed = _setup(
        p0={"teacher-weights": "a" * 64}, p1={"teacher-weights": "b" * 64}, p2={"teacher-weights": "a" * 64}
    )
    with pytest.raises(
        ValueError, match=r"aaaaaaaaaaaa -> \[0, 2\]; bbbbbbbbbbbb -> \[1\]\): give every node"
    ):
        check_teachers(mixed, fed)


def test_a_node_numbering_classes_differently_from_the_test_set_is_named() -> None:
    test = SimpleNamespace(class_names=["cat", "dog"])
    ok, fed = _setup(p0={"class-names": ["cat", "dog"]}, p1={"class-names": ["cat", "dog"]})
    check_classes(ok, fed, test)
    bad, fed = _setup(p0={"class-names": ["cat", "dog"]}, p1={"class-names": ["dog", "cat"]})
    with pytest.raises(ValueError, match=r"node 101 \(partition-id 1\) numbers its classes \['dog', 'cat'\]"):
        check_classes(bad, fed, test)
