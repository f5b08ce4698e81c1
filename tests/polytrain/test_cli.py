"""The `polytrain` client commands against a real HTTP server: login, projects, submit from
YAML, tasks, status, logs (also --follow over server-sent events), download (--logs,
--checkpoint), retry, cancel, logout."""

import re
from pathlib import Path

import pytest

from tests.conftest import ADMIN_EMAIL, PASSWORD, add_account, agent_headers, make_group

GOOD = b"""
def build_model(): ...
def build_datasets(): ...
def build_optimizer(params): ...
def loss_fn(output, target): ...
"""


def test_login_submit_status_logs_cancel(run, server: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import httpx

    add_account(ADMIN_EMAIL, admin=True)
    login = run("login", "--email", ADMIN_EMAIL, input=f"{PASSWORD}\n")
    assert login.exit_code == 0, login.output
    assert f"as {ADMIN_EMAIL} (admin)" in login.output
    assert (tmp_path / "credentials.json").stat().st_mode & 0o777 == 0o600
    token = __import__("json").loads((tmp_path / "credentials.json").read_text())["token"]
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {token}"}) as api:
        make_group(api, "cpu-a", capacity=2)  # type: ignore[arg-type]
    (tmp_path / "train.py").write_bytes(GOOD)
    (tmp_path / "task.yaml").write_text(
        "project: digits\ncode: train.py\nname: from yaml\nepochs: 2\n"
        "global_batch_size: 8\nresource_groups:\n  - {name: cpu-a, workers: 2}\n"
    )
    submitted = run("submit", str(tmp_path / "task.yaml"))
    assert submitted.exit_code == 0, submitted.output
    assert "task 1 submitted: from yaml (QUEUED)" in submitted.output
    assert "digits" in run("projects").output
    status = run("status", "1")
    assert "QUEUED" in status.output and "cpu-a×2" in status.output
    assert re.search(r"time to finish\s+—", status.output)  # no step measured yet

    httpx.post(
        f"{server}/internal/v1/tasks/1/logs",
        headers=agent_headers(),
        json={
            "lines": [
                {"node": "ps", "seq": 0, "time": "2026-01-01T00:00:00", "text": "hello from ps"}
            ]
        },
    )
    assert "hello from ps" in run("logs", "1").output
    cancelled = run("cancel", "1")
    assert "task 1 CANCELLED" in cancelled.output
    followed = run("logs", "1", "--follow")
    assert "hello from ps" in followed.output and "task ended: CANCELLED" in followed.output
    again = run("cancel", "1")
    assert again.exit_code == 1 and "it cannot become CANCELLED" in again.output
    assert run("logout").exit_code == 0
    assert not (tmp_path / "credentials.json").exists()


def test_submit_passes_sharding_and_a_groups_own_on_to_the_api(  # type: ignore[no-untyped-def]
    run, server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    account = add_account(ADMIN_EMAIL, admin=True)
    monkeypatch.setenv("POLYTRAIN_TOKEN", account.token)
    with httpx.Client(base_url=server, headers=account.headers) as api:
        make_group(api, "cpu-a", capacity=2)  # type: ignore[arg-type]
        make_group(api, "cpu-b", capacity=2)  # type: ignore[arg-type]
        (tmp_path / "train.py").write_bytes(GOOD)
        task_file = tmp_path / "task.yaml"
        head = "project: digits\ncode: train.py\nglobal_batch_size: 8\nsharding: fsdp\n"
        task_file.write_text(
            f"{head}fsdp_units: [Linear]\nresource_groups:\n  - {{name: cpu-a, workers: 2}}\n"
            "  - {name: cpu-b, workers: 2, sharding: none}\n"
        )
        submitted = run("submit", str(task_file))
        assert submitted.exit_code == 0, submitted.output
        spec = api.get("/api/v1/tasks/1").json()["spec"]
        assert (spec["sharding"], spec["fsdp_units"]) == ("fsdp", ["Linear"])
        assert [item.get("sharding") for item in spec["request"]] == [None, "none"]

        task_file.write_text(f"{head}resource_groups:\n  - {{name: cpu-a, workers: 1}}\n")
        refused = run("submit", str(task_file))
        assert refused.exit_code == 1
        assert "(field sharding)" in refused.output and "nothing to shard" in refused.output
        assert len(api.get("/api/v1/tasks").json()) == 1


def test_refusals_are_clear(run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    add_account("ada@example.org")
    wrong = run("login", "--email", "ada@example.org", input="nope\n")
    assert wrong.exit_code == 1 and "wrong email or password" in wrong.output
    monkeypatch.setenv("POLYTRAIN_TOKEN", "pt_revoked-or-made-up")
    refused = run("status", "1")
    assert refused.exit_code == 1 and "invalid API token" in refused.output
    (tmp_path / "bad.yaml").write_text("name: no project\n")
    bad = run("submit", str(tmp_path / "bad.yaml"))
    assert bad.exit_code == 1 and "at least 'project'" in bad.output


def test_first_admin_from_the_cli_then_groups_ensure(
    run,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    created = run("users", "create-admin", "root@example.org", "--password", "long enough")
    assert created.exit_code == 0 and "created" in created.output
    anonymous = run("groups", "ensure", "cpu-b")
    assert anonymous.exit_code == 2 and "log in" in anonymous.output
    monkeypatch.setenv("POLYTRAIN_ADMIN_EMAIL", "root@example.org")
    monkeypatch.setenv("POLYTRAIN_ADMIN_PASSWORD", "long enough")
    first = run("groups", "ensure", "cpu-b", "--capacity", "1")
    assert first.exit_code == 0 and "resource group cpu-b: created" in first.output
    assert "resource group cpu-b: exists" in run("groups", "ensure", "cpu-b").output


def test_download_logs_to_a_file_or_stdout(  # type: ignore[no-untyped-def]
    run, server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`polytrain download TASK --logs` writes `logs.txt` to a file or standard output, one
    node's with --node; a node or task that is not there is a clear error and no file."""
    import httpx

    account = add_account(ADMIN_EMAIL, admin=True)
    monkeypatch.setenv("POLYTRAIN_TOKEN", account.token)
    with httpx.Client(base_url=server, headers=account.headers) as api:
        make_group(api, "cpu-a", capacity=2)  # type: ignore[arg-type]
    (tmp_path / "train.py").write_bytes(GOOD)
    (tmp_path / "task.yaml").write_text(
        "project: digits\ncode: train.py\nglobal_batch_size: 8\n"
        "resource_groups:\n  - {name: cpu-a, workers: 2}\n"
    )
    assert run("submit", str(tmp_path / "task.yaml")).exit_code == 0
    lines = [
        {"node": node, "seq": seq, "time": f"2026-01-01T00:00:0{i}", "text": f"{node} says {i}"}
        for i, (node, seq) in enumerate([("ps", 0), ("rank-1", 0), ("ps", 1)])
    ]
    httpx.post(
        f"{server}/internal/v1/tasks/1/logs", headers=agent_headers(), json={"lines": lines}
    ).raise_for_status()

    saved = run("download", "1", "--logs", "-o", str(tmp_path / "all.txt"))
    assert saved.exit_code == 0, saved.output
    assert (tmp_path / "all.txt").read_text().splitlines() == [
        "2026-01-01T00:00:00.000Z ps       ps says 0",
        "2026-01-01T00:00:01.000Z rank-1   rank-1 says 1",
        "2026-01-01T00:00:02.000Z ps       ps says 2",
    ]
    printed = run("download", "1", "--logs", "--node", "ps")
    assert printed.exit_code == 0
    assert printed.stdout.splitlines() == [
        "2026-01-01T00:00:00.000Z ps       ps says 0",
        "2026-01-01T00:00:02.000Z ps       ps says 2",
    ]
    unknown = run("download", "1", "--logs", "--node", "rank-9", "-o", str(tmp_path / "x.txt"))
    assert unknown.exit_code == 1
    assert "task 1 has no node 'rank-9' (its nodes: ps, rank-1, rank-2, agent-cpu-a)" in (
        unknown.output
    )
    assert not (tmp_path / "x.txt").exists()
    missing = run("download", "7", "--logs")
    assert missing.exit_code == 1 and "task 7 does not exist" in missing.output
    nothing = run("download", "1")
    assert nothing.exit_code == 2 and "say what to download" in nothing.output


def test_tasks_list_retry_and_checkpoint_download(  # type: ignore[no-untyped-def]
    run, server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`polytrain tasks` filters by project (name or id) and status and pages with a count;
    `retry` resubmits an ended task and refuses a live one; `download --checkpoint` saves
    the latest (or a named) checkpoint byte for byte, and says what it lacks."""
    import httpx

    account = add_account(ADMIN_EMAIL, admin=True)
    monkeypatch.setenv("POLYTRAIN_TOKEN", account.token)
    with httpx.Client(base_url=server, headers=account.headers) as api:
        make_group(api, "cpu-a", capacity=2)  # type: ignore[arg-type]
    (tmp_path / "train.py").write_bytes(GOOD)
    for project, name, epochs in [("digits", "d1", 1), ("digits", "d2", 3), ("faces", "f1", 1)]:
        (tmp_path / "task.yaml").write_text(
            f"project: {project}\ncode: train.py\nname: {name}\nglobal_batch_size: 8\n"
            f"epochs: {epochs}\ntags: [{'baseline' if name == 'f1' else 'x, ' + name}]\n"
            "resource_groups:\n  - {name: cpu-a, workers: 2}\n"
        )
        assert run("submit", str(tmp_path / "task.yaml")).exit_code == 0
    assert run("cancel", "1").exit_code == 0

    listed = run("tasks", "--project", "digits")
    assert listed.exit_code == 0, listed.output
    assert "d1" in listed.output and "d2" in listed.output and "f1" not in listed.output
    assert "1-2 of 2 tasks" in listed.output
    cancelled = run("tasks", "--status", "cancelled")
    assert "d1" in cancelled.output and "CANCELLED" in cancelled.output
    assert "d2" not in cancelled.output and "1-1 of 1 tasks" in cancelled.output
    paged = run("tasks", "--limit", "1", "--offset", "1")
    assert "2-2 of 3 tasks" in paged.output and "d2" in paged.output  # newest first: f1, d2
    assert "f1" not in paged.output
    tagged = run("tasks", "--tag", "x", "--tag", "d2")
    assert "d2" in tagged.output and "d1" not in tagged.output and "1-1 of 1" in tagged.output
    named = run("tasks", "--name", "D")
    assert "1-2 of 2 tasks" in named.output and "f1" not in named.output
    compared = run("compare", "1", "2")
    assert compared.exit_code == 0, compared.output
    assert re.search(r"epochs\s+│\s+1\s+│\s+3", compared.output), compared.output
    alone = run("compare", "1")
    assert alone.exit_code == 1 and "compare 2 to 10 different tasks" in alone.output
    unknown = run("tasks", "--project", "nope")
    assert unknown.exit_code == 1 and "no project named 'nope'" in unknown.output

    retried = run("retry", "1")
    assert retried.exit_code == 0, retried.output
    assert "task 4 submitted: d1 (retry of 1)" in retried.output
    live = run("retry", "2")
    assert live.exit_code == 1 and "only an ended task is retried" in live.output

    none = run("download", "1", "--checkpoint", "latest")
    assert none.exit_code == 1 and "task 1 has no checkpoint" in none.output
    for epoch, blob in [(0, b"epoch zero"), (1, b"epoch one \x00\xff")]:
        httpx.post(
            f"{server}/internal/v1/tasks/1/checkpoints",
            headers=agent_headers(),
            params={"name": f"epoch-{epoch}.pt", "epoch": epoch, "step": 10 * (epoch + 1)},
            content=blob,
        ).raise_for_status()
    monkeypatch.chdir(tmp_path)
    latest = run("download", "1", "--checkpoint", "latest")
    assert latest.exit_code == 0, latest.output
    assert (tmp_path / "task1-checkpoint2.pt").read_bytes() == b"epoch one \x00\xff"
    assert "checkpoint 2 (epoch 1, step 20)" in latest.output
    first = run("download", "1", "--checkpoint", "1", "-o", str(tmp_path / "first.pt"))
    assert first.exit_code == 0 and (tmp_path / "first.pt").read_bytes() == b"epoch zero"
    missing = run("download", "1", "--checkpoint", "9")
    assert missing.exit_code == 1 and "task 1 has no checkpoint 9" in missing.output
    both = run("download", "1", "--logs", "--checkpoint", "latest")
    assert both.exit_code == 2 and "--logs [--node NODE], or --checkpoint" in both.output


def test_time_to_finish_reads_the_apis_estimate() -> None:
    from polytrain.client.commands import _eta

    assert _eta({"eta_s": None, "predicted_finish_at": None}) == "—"
    running = {"eta_s": 725.4, "predicted_finish_at": "2026-11-26T09:03:00Z"}
    assert _eta(running) == "12 min 5 s (at 2026-11-26T09:03:00Z)"
    assert _eta({"eta_s": 0.0, "predicted_finish_at": "2026-11-26T09:03:00Z"}).startswith("0 s")


@pytest.mark.registry
@pytest.mark.usefixtures("registry")
def test_upload_with_a_requirements_file(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`polytrain upload` sends a module with its requirements file; the portal's lock is
    printed as its packages, and a refusal names the requirement."""
    monkeypatch.setenv("POLYTRAIN_TOKEN", add_account(ADMIN_EMAIL, admin=True).token)
    (tmp_path / "train.py").write_bytes(GOOD)
    (tmp_path / "requirements.txt").write_text("einops\n")
    uploaded = run(
        "upload",
        "digits",
        str(tmp_path / "train.py"),
        "--requirements",
        str(tmp_path / "requirements.txt"),
    )
    assert uploaded.exit_code == 0, uploaded.output
    assert "code version 1 (v1) of project 1: train.py" in uploaded.output
    assert re.search(r"^  einops==\S+$", uploaded.output, re.MULTILINE)
    (tmp_path / "requirements.txt").write_text("torch==2.12.0\n")
    refused = run(
        "upload",
        "digits",
        str(tmp_path / "train.py"),
        "--requirements",
        str(tmp_path / "requirements.txt"),
    )
    assert refused.exit_code == 1
    assert "torch==2.12.0 would replace the platform's torch" in refused.output
    assert "(field requirements)" in refused.output
