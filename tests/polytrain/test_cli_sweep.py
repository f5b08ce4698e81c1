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
