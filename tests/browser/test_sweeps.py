"""A hyperparameter sweep in Chromium: started from the project's sweeps form (a refusal
keeps what was typed), 2 trials of a tiny module to completion, one at a time, each on both
groups of the stack (cpu-a:1 and cpu-b:1, one epoch of 32 samples), and the sweep page with
every trial, the best highlighted and the metric charted per parameter."""

import re

import httpx
from playwright.sync_api import Page, expect

from polytrain.stack import LocalStack
from tests.browser.conftest import log_in

MODULE = b"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

HYPERPARAMETERS = {"lr": 0.02, "hidden": 8}


def build_datasets():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:])


def build_model():
    width = int(HYPERPARAMETERS["hidden"])
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


def build_optimizer(params):
    return torch.optim.SGD(params, lr=float(HYPERPARAMETERS["lr"]))


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""


def test_a_sweep_of_two_trials_on_both_groups_runs_to_completion(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    project = api.post("/api/v1/projects", json={"name": "sweeps"}).json()
    api.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", MODULE)},
    ).raise_for_status()
    log_in(page, stack)
    page.goto(f"{stack.url}/projects/{project['id']}")
    page.click("#sweeps-link")
    expect(page.locator("#no-sweeps")).to_be_visible()
    page.fill("#sweep-name", "lr and width")
    page.fill("#sweep-groups", "cpu-a:1, cpu-b:1")
    page.fill("#sweep-epochs", "1")
    page.fill("#sweep-batch", "16")
    page.fill("#sweep-space", '{"lr": [0.05, 0.01], "depth": [8, 16]}')
    page.fill("#sweep-trials", "2")  # the grid's first two: lr 0.05 with hidden 8, 16
    page.fill("#sweep-parallel", "1")  # cpu-b has one worker: one trial at a time
    page.click("#start-sweep-button")
    expect(page.locator("#error-space")).to_contain_text("'depth' is not declared")
    expect(page.locator("#sweep-name")).to_have_value("lr and width")  # kept as typed
    page.fill("#sweep-space", '{"lr": [0.05, 0.01], "hidden": [8, 16]}')
    page.click("#start-sweep-button")
    expect(page.locator("#sweep-status")).to_have_text("RUNNING")
    expect(page.locator("#trials-table tbody tr")).to_have_count(2)  # 1 trial, 1 waiting
    expect(page.locator("#sweep-status")).to_have_text("FINISHED", timeout=180_000)
    sweep_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    sweep = api.get(f"/api/v1/sweeps/{sweep_id}").json()
    assert [t["status"] for t in sweep["trials"]] == ["SUCCEEDED"] * 2, sweep["trials"]
    assert [tuple(t["hyperparameters"].values()) for t in sweep["trials"]] == [
        (0.05, 8),
        (0.05, 16),
    ]
    assert all(sorted(t["groups"]) == ["cpu-a", "cpu-b"] for t in sweep["trials"]), sweep["trials"]
    best = page.locator("#trials-table tr.best")
    expect(best).to_have_count(1)
    expect(best).to_have_attribute("data-trial", str(sweep["best"]["index"]))
    expect(page.locator("#sweep-best")).to_contain_text(f"trial {sweep['best']['index']}")
    for index in (0, 1):  # lr and hidden, each with a point per trial
        expect(page.locator(f"#sweep-chart-{index}")).to_have_attribute("data-points", "2")
    page.click("#sweeps-link")
    expect(page.locator("#sweeps-table")).to_contain_text(re.compile(r"FINISHED"))
