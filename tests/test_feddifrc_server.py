"""FedDifRC's server half (methods/feddifrc/server.py): what the setup query asks, the basis it
fits from the replies, the records it adds to every train message and what a checkpoint keeps."""

from __future__ import annotations

import numpy as np
from conftest import make_config
from flwr.app import ConfigRecord, RecordDict

from feddifrc_app import methods
from feddifrc_app.methods.feddifrc.projection import (
    BASIS,
    Basis,
    client_stats,
    fit_federated_basis,
    stats_from_arrays,
    stats_to_arrays,
)
from feddifrc_app.methods.feddifrc.server import FedDifRCServer
from feddifrc_app.records import arrays_to_record, record_to_arrays
from feddifrc_app.results import Results

CHANNELS = {1: 32, 2: 16, 3: 16}  # a tiny teacher's pooled block widths; fused: 16 + 8 + 8 = 32 = 8 x 4


def _reply(seed: int, misses: int, device: str) -> RecordDict:
    rng = np.random.default_rng(seed)
    pooled = {b: rng.standard_normal((6, 3, c)) for b, c in CHANNELS.items()}  # 6 images x 3 prompts
    info = {"teacher-model": "tiny", "teacher-weights": "a" * 64, "teacher-random-weights": True}
    info |= {"teacher-device": device, "teacher-cache-misses": misses}
    return RecordDict(
        {"info": ConfigRecord(info), "pca-stats": arrays_to_record(stats_to_arrays(client_stats(pooled)))}
    )


def test_the_basis_is_fitted_once_from_the_replies_sent_with_every_train_message_and_checkpointed():
    cfg = make_config(**{"model.width": 4, "diffusion.channels": "16,8,8"})
    assert cfg.diffusion.projection == "federated-pca"
    half = methods.server_half(cfg)  # the run's server halves, as the ServerApp builds them
    assert half.setup_work() and half.train_records() == {}
    setup, partition_of = {11: _reply(0, 4, "cpu float32"), 12: _reply(1, 2, "cuda float16")}, {11: 1, 12: 0}
    results = Results(rounds=[], resumed=[])
    half.after_setup(setup, partition_of, results)

    stats = [record_to_arrays(setup[n]["pca-stats"]) for n in (11, 12)]
    want, merged = fit_federated_basis([stats_from_arrays(s) for s in stats], (16, 8, 8), (1, 2, 3), 32)
    sent = half.train_records()
    assert list(sent) == [BASIS]
    assert Basis.from_arrays(record_to_arrays(sent[BASIS])).fingerprint() == want.fingerprint()
    assert results.extra["basis"] == {
        "mode": "federated-pca",
        "fingerprint": want.fingerprint(),
        "rows": 2 * 6 * 3,
        "nodes": 2,
        "widths": [16, 8, 8],
    }
    assert results.extra["setup-cache-misses"] == 6
    assert list(results.extra) == ["basis", "setup-cache-misses", "teacher"]  # in results.json's order
    assert set(results.extra) <= set(methods.results_keys())  # each declared: typed on load
    assert results.extra["teacher"]["devices"] == {"cuda float16": [0], "cpu float32": [1]}  # partition order
    assert not half.setup_work()  # once

    # A resumed run continues with the checkpoint's basis and asks the nodes for nothing.
    resumed = FedDifRCServer(cfg)
    resumed.restore(half.state())
    assert not resumed.setup_work()
    got = resumed.train_records()[BASIS]
    assert all(np.array_equal(got[k].numpy(), sent[BASIS][k].numpy()) for k in sent[BASIS])


def test_other_projections_fit_nothing_and_other_methods_have_no_server_half():
    cfg = make_config(**{"diffusion.projection": "random"})
    half = FedDifRCServer(cfg)
    results = Results(rounds=[], resumed=[])
    half.after_setup({11: _reply(0, 0, "cpu float32")}, {11: 0}, results)
    assert not half.setup_work() and half.train_records() == {} and "basis" not in results.extra
    assert results.extra["teacher"]["model"] == "tiny" and half.state() == {"basis": None}
    fedavg = methods.server_half(make_config(method="fedavg"))
    assert fedavg.halves == [] and not fedavg.setup_work() and fedavg.state() == {}
