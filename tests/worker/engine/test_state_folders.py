"""A worker's optimizer state written into a checkpoint's state folder and read back whole
(worker/engine/fsdp.py ``save_state`` / ``load_state_rows``): every state the user's
optimizer keeps, whether or not shaped as its parameter."""

from pathlib import Path

import pytest
import torch

from worker.engine.fsdp import load_state_rows, save_state


@pytest.mark.parametrize(
    "build",
    [
        lambda p: torch.optim.Adam(p, lr=0.1),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adafactor(p),  # row and column variances, not shaped as p
    ],
    ids=["adam", "sgd-momentum", "adafactor"],
)
def test_a_written_state_reads_back_as_it_was(build, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    optimizer = build(model.parameters())
    for _ in range(2):
        model(torch.randn(3, 8)).pow(2).sum().backward()
        optimizer.step()
    outline = save_state(optimizer, tmp_path / "step-2.pt.g0.dcp", None, sharded=False)  # type: ignore[arg-type]
    again = build(model.parameters())
    load_state_rows(again, outline, tmp_path / "step-2.pt.g0.dcp")
    before, after = optimizer.state_dict(), again.state_dict()
    assert before["param_groups"] == after["param_groups"]
    assert before["state"].keys() == after["state"].keys()
    for key, state in before["state"].items():
        assert state.keys() == after["state"][key].keys()
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(after["state"][key][name]), torch.as_tensor(value))
