"""A worker's gradient vector (`compute.local_gradient`): each gradient scaled by the local
count into one vector, in the parameters' promoted dtype, a frozen parameter's slice zero, then
the buffers' change and `[loss_sum, count]`: what concatenating and then scaling gave."""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from worker.engine.compute import local_gradient
from worker.engine.contract import TrainingCode
from worker.engine.data import TensorData
from worker.engine.exchange import params_of


class Mixed(nn.Module):
    """A bfloat16 layer, then a frozen float32 one, then a float32 one."""

    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Linear(4, 6).to(torch.bfloat16)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.low(x.to(torch.bfloat16)).float()))


def test_the_vector_is_the_scaled_concatenation_in_the_promoted_dtype() -> None:
    torch.manual_seed(0)
    model = Mixed()
    x, y = torch.randn(10, 4), torch.randn(10, 1)
    leaves, spec = tree_flatten((x, y))
    data = TensorData(leaves, spec)
    code = TrainingCode(
        module=types.ModuleType("user"),
        build_model=Mixed,
        build_datasets=lambda: (None, None),
        build_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=nn.functional.mse_loss,
        metrics=None,
    )
    indices = torch.tensor([1, 3, 4, 8, 9])
    vector = local_gradient(code, model, data, indices, torch.device("cpu"))

    params = params_of(model)
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    expected = torch.cat(parts) * len(indices)  # what the engine did before (cat promotes)
    loss = nn.functional.mse_loss(model(x[indices]), y[indices])
    assert vector.dtype == torch.float32 and vector.shape == (expected.numel() + 2,)
    assert torch.equal(vector[:-2], expected)
    frozen = sum(p.numel() for p in params[:2])
    assert torch.count_nonzero(vector[frozen : frozen + 42]) == 0  # the frozen layer's 36 + 6
    assert vector[-1] == 5 and torch.isclose(vector[-2], loss.detach() * 5)
