"""Issue 5 on the real capture iter_40000_p2p_iter10: the replica starts from the initial weights
on the wire (torch.manual_seed(2024); nn.Linear(5000, 1, bias=False)) and applies the 20
iterations with Adam; an independent plain-torch loop over the same reduced gradients (each one
checked against truth.json) must give the same bits after every step."""

from __future__ import annotations

import hashlib

import pytest
import torch
from common import FLOWCHECK
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.tools.cmd_replay import run
from mirrorckpt.updater.fingerprint import state_sha256
from torch import nn

pytestmark = pytest.mark.offline  # capture files in one process: runs beside the unit tests


CAPTURE = FLOWCHECK / "iter_40000_p2p_iter10.pcapng"


def test_replica_equals_independent_adam(truth):
    steps = []
    training = lambda layout: TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=1e-3),  # noqa: E731
                                           grad_dtype=layout.grad_dtype)
    js, results, iterations, app = run(
        [str(CAPTURE)], training=training, p2p_fill=True,  # the workload sends the values rank 0's egress lacks
        progress=lambda i, replica: steps.append(state_sha256(replica.params, replica.optimizer)))
    assert app.summary.iterations_applied == 20 and len(steps) == 20

    torch.manual_seed(2024)
    model = nn.Linear(5000, 1, bias=False)
    init_wire = [r for r in results if r.spec.label == "init_params:0"][0].values()
    assert torch.equal(torch.from_numpy(init_wire.copy()).view(1, 5000), model.weight.detach())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    want = truth[CAPTURE.name]["allreduce_instances"]
    grads = [r for r in results if r.spec.kind == "allreduce"]
    for k, (r, w) in enumerate(zip(grads, want)):
        assert hashlib.sha256(r.data.tobytes()).hexdigest() == w["sha256"]
        model.weight.grad = torch.from_numpy(r.values().copy()).view(1, 5000)
        opt.step()
        assert state_sha256([model.weight], opt) == steps[k], f"step {k}"
