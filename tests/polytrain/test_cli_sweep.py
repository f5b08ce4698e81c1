"""`polytrain sweep start|list|show|cancel` against a real HTTP server."""

from pathlib import Path

import pytest

from tests.conftest import ADMIN_EMAIL, add_account, make_group


def test_sweep_start_list_show_cancel(  # type: ignore[no-untyped-def]
    run, server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    account = add_account(ADMIN_EMAIL, admin=True)
    monkeypatch.setenv("POLYTRAIN_TOKEN", account.token)
    with httpx.Client(base_url=server, headers=account.headers) as api:
        make_group(api, "cpu-a", capacity=2)  # type: ignore[arg-type]
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(
        "project: digits\nexample: mnist_cnn\nname: widths\nepochs: 2\nglobal_batch_size: 8\n"
        "resource_groups:\n  - {name: cpu-a, workers: 1}\n"
        "sweep:\n  space:\n    hidden: [16, 32, 64]\n  parallel: 2\n"
    )
    started = run("sweep", "start", str(sweep_file))
    assert started.exit_code == 0, started.output
    assert "sweep 1 started: widths (3 trials, 2 submitted)" in started.output
    listed = run("sweep", "list", "--project", "digits")
    assert "widths" in listed.output and "2/3" in listed.output and "1 of 1 sweeps" in listed.output
    shown = run("sweep", "show", "1")
    assert "sweep 1: widths (RUNNING)" in shown.output
    assert "waiting" in shown.output and "QUEUED" in shown.output
    cancelled = run("sweep", "cancel", "1")
    assert cancelled.exit_code == 0 and "sweep 1 CANCELLED" in cancelled.output
    again = run("sweep", "cancel", "1")
    assert again.exit_code == 1 and "cannot be cancelled" in again.output

    sweep_file.write_text(sweep_file.read_text().replace("hidden", "depth"))
    refused = run("sweep", "start", str(sweep_file))
    assert refused.exit_code == 1
    assert "'depth' is not declared" in refused.output and "(field space.depth)" in refused.output


def test_sweep_names_print_as_written_not_as_rich_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    """A metric or hyperparameter name like "[/x]" is Rich markup (a closing tag): printed
    unescaped it raised MarkupError or vanished."""
    from typer.testing import CliRunner

    from polytrain.cli import app as cli
    from polytrain.client import sweeps

    trial = {
        "index": 1,
        "task_id": 7,
        "status": "SUCCEEDED",
        "stopped_early": False,
        "objective": 0.5,
        "epochs": 2,
        "hyperparameters": {"[/x]": 3, "[b]lr": 0.1},
    }
    sweep = {
        "id": 1,
        "name": "odd",
        "status": "FINISHED",
        "reason": "",
        "algorithm": "grid",
        "submitted": 1,
        "planned": 1,
        "parallel": 1,
        "goal": "min",
        "metric": "[/x]",
        "space": {"[/x]": {"values": [3]}, "[b]lr": {"values": [0.1]}},
        "trials": [trial],
        "best": trial,
        "pending": [],
        "project_id": 1,
        "created_at": "2026-01-01T00:00:00Z",
    }

    class FakeApi:
        @classmethod
        def resolve(cls, url: str | None = None) -> "FakeApi":
            return cls()

        def get(self, path: str) -> dict:
            return sweep

        def listing(self, path: str, params: dict) -> tuple[list, int]:
            return [sweep], 1

    monkeypatch.setattr(sweeps, "Api", FakeApi)
    monkeypatch.setattr(sweeps.console, "width", 200)
    runner = CliRunner()
    shown = runner.invoke(cli, ["sweep", "show", "1"], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert "min [/x]" in shown.output and "[/x] 0.5 with [/x]=3, [b]lr=0.1" in shown.output
    assert shown.output.count("[b]lr") == 2  # the table's header and the best's line
    listed = runner.invoke(cli, ["sweep", "list"], catch_exceptions=False)
    assert listed.exit_code == 0 and "min [/x]" in listed.output, listed.output
