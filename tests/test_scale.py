"""What keeps a federation of thousands of nodes affordable (benchmarks/scale.py measures it):
the federated basis from a seeded sample of nodes (``diffusion.basis-nodes``), a label plot of
fixed size, and the benchmark's data (shifted copies of mnist-5k's digits)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
from conftest import ROOT, default_run_config
from flwr.app import Context, RecordDict

from feddifrc_app.config_loader import load_config
from feddifrc_app.methods.feddifrc.projection import STATS

sys.path.insert(0, str(ROOT / "benchmarks"))

NODES = 4


def _serve(link, nodes: dict[int, int], run_config: dict, stop: threading.Event) -> None:
    """Each node's side, as a SuperNode does: take its messages from the LinkState, answer them with
    the app's real ClientApp, store the replies."""
    from uuid import uuid4

    from feddifrc_app.client_app import app

    contexts = {
        n: Context(
            run_id=link.grid._run.run_id,
            node_id=n,
            node_config={"partition-id": p, "num-partitions": len(nodes)},
            state=RecordDict(),
            run_config=run_config,
        )
        for n, p in nodes.items()
    }
    while not stop.is_set():
        for n in nodes:
            for msg in link.state.get_message_ins(node_id=n, limit=None):
                reply = app(msg, contexts[n])
                reply.metadata.__dict__["_message_id"] = str(uuid4())
                link.state.store_message_res(reply)
        stop.wait(0.05)


def _setup(tmp_path: Path, basis_nodes: int) -> tuple[dict, dict[int, int], object]:
    """The setup exchange of NODES nodes over a real LinkState and Grid: (replies, partition of node,
    the FedDifRC server half after it)."""
    from fakes import SuperLink
    from flwr.supercore.task_identity import TaskIdentity

    from feddifrc_app.federation import Federation
    from feddifrc_app.methods import server_half
    from feddifrc_app.results import Results

    rc = default_run_config(
        dataset__train_limit=80, diffusion__basis_nodes=basis_nodes, diffusion__cache_dir=str(tmp_path)
    )
    cfg = load_config(rc)
    link = SuperLink()
    TaskIdentity.run_id = link.grid._run.run_id  # messages carry the process's run (conftest restores it)
    nodes = {link.supernode(): p for p in range(NODES)}
    stop = threading.Event()
    server = threading.Thread(target=_serve, args=(link, nodes, rc, stop), daemon=True)
    server.start()
    try:
        fed = Federation(link.grid, cfg)
        half = server_half(cfg)
        setup = fed.setup(sorted(nodes), half.setup_work(), half.setup_nodes())
        results = Results()
        half.after_setup(setup, fed.partition_of, results)
    finally:
        stop.set()
        server.join()
    return setup, fed.partition_of, results


def test_the_basis_from_a_sample_asks_every_node_who_it_is_and_only_the_sample_for_statistics(
    tmp_path: Path,
) -> None:
    setup, partition_of, results = _setup(tmp_path, basis_nodes=2)
    assert sorted(partition_of.values()) == list(range(NODES))  # every node said who it is
    assert sorted(setup) == sorted(partition_of)
    sampled = [n for n, c in setup.items() if STATS in c]
    assert len(sampled) == 2 and results.extra["basis"]["nodes"] == 2
    # The basis's rows: the sampled nodes' images under each of the 10 class prompts and the NDCR one.
    assert results.extra["basis"]["rows"] == 11 * sum(int(setup[n]["info"]["num-examples"]) for n in sampled)
    # Drawn in partition order from the run seed: other node ids (a new run) draw the same partitions.
    again, again_of, again_results = _setup(tmp_path, basis_nodes=2)
    assert sorted(again_of[n] for n, c in again.items() if STATS in c) == sorted(
        partition_of[n] for n in sampled
    )
    assert again_results.extra["basis"]["fingerprint"] == results.extra["basis"]["fingerprint"]


def test_the_label_plot_of_thousands_of_nodes_has_the_width_of_sixty(tmp_path: Path) -> None:
    from PIL import Image

    from feddifrc_app.tools.report import MAX_BARS, plot_label_distribution

    names = [f"c{k}" for k in range(10)]
    widths = {}
    for m in (10, MAX_BARS, 5000):
        counts = np.random.default_rng(0).integers(0, 4, (m, 10))
        plot_label_distribution(counts, names, tmp_path / f"{m}.png", f"{m} clients")
        with Image.open(tmp_path / f"{m}.png") as im:
            widths[m] = im.size[0]
    assert widths[10] < widths[MAX_BARS] == widths[5000]


def test_the_benchmark_data_is_each_digit_and_four_copies_moved_two_pixels() -> None:
    from scale import SHIFT, shifted

    x = np.arange(1, 2 * 28 * 28 + 1, dtype=np.int64).reshape(2, 28, 28)
    copies = shifted(x)
    assert len(copies) == 5 and copies[0] is x
    down, up, right, left = copies[1:]
    assert (down[:, SHIFT:] == x[:, :-SHIFT]).all() and (down[:, :SHIFT] == 0).all()
    assert (up[:, :-SHIFT] == x[:, SHIFT:]).all() and (up[:, -SHIFT:] == 0).all()
    assert (right[:, :, SHIFT:] == x[:, :, :-SHIFT]).all() and (right[:, :, :SHIFT] == 0).all()
    assert (left[:, :, :-SHIFT] == x[:, :, SHIFT:]).all() and (left[:, :, -SHIFT:] == 0).all()
    assert (x != 0).all()  # the input is untouched
