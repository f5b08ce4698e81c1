"""Drive the namespace cluster of `netns_cluster.sh` from the API's host: groups, one task
across both agents, checks that its nodes ran on the agents' addresses; one JSON line.

    python scripts/netns_check.py API_URL ADMIN_EMAIL ADMIN_PASSWORD ADDR_A ADDR_B groups|task
"""

import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# netns_cluster.sh listens here, on the broker's host, which runs no rank.
PROBE_HOST, PROBE_PORT = "10.77.0.2", 45000


def wait(check, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = check()
            if found:
                return found
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} within {timeout_s:.0f} s")


def client(url: str, email: str, password: str) -> httpx.Client:
    """An admin's client of the API, once the API answers."""
    wait(lambda: httpx.get(f"{url}/api/v1/health").status_code == 200, 90, "API up")
    token = httpx.post(
        f"{url}/api/v1/auth/login",
        json={"email": email, "password": password, "token_name": "netns"},
    ).json()["token"]
    return httpx.Client(
        base_url=f"{url}/api/v1", timeout=30, headers={"Authorization": f"Bearer {token}"}
    )


def create_groups(api: httpx.Client) -> None:
    for name, capacity in (("cpu-a", 2), ("cpu-b", 1)):
        response = api.post(
            "/resource-groups", json={"name": name, "device_type": "cpu", "capacity": capacity}
        )
        assert response.status_code in (201, 409), response.text


PROBE = f"""

def _probe():
    import socket
    try:
        socket.create_connection(("{PROBE_HOST}", {PROBE_PORT}), timeout=3).close()
        return "connected"
    except OSError as exc:
        return "refused " + type(exc).__name__


print("probe " + _probe(), flush=True)
"""


def control_probe() -> str:
    """The same connection from this (unsandboxed) client: the listener is there."""
    scope: dict[str, object] = {}
    exec(PROBE.replace('print("probe " + _probe(), flush=True)', ""), scope)  # noqa: S102
    return str(scope["_probe"]())  # type: ignore[operator]


def run_task(api: httpx.Client, addr_a: str, addr_b: str) -> int:
    started = time.monotonic()
    wait(
        lambda: all(g["agents_online"] for g in api.get("/resource-groups").json()),
        120,
        "agents online",
    )
    project = api.post("/projects", json={"name": "netns"}).json()
    # The example, plus a probe: each rank tries a listener on the broker's host, on a port in
    # the ephemeral range where rendezvous ports lie. That host runs no rank of the task.
    source = (ROOT / "examples" / "tiny_regression.py").read_text() + PROBE
    version = api.post(
        f"/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", source.encode(), "text/x-python")},
    ).json()
    task = api.post(
        "/tasks",
        json={
            "project_id": project["id"],
            "code_version_id": version["id"],
            "epochs": 3,
            "global_batch_size": 16,
            "resource_groups": [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
        },
    ).json()
    done = wait(
        lambda: (
            (t := api.get(f"/tasks/{task['id']}").json())["status"]
            in ("SUCCEEDED", "FAILED", "CANCELLED")
            and t
        ),
        300,
        "task ended",
    )
    probes = sorted(
        {
            line["text"]
            for line in api.get(f"/tasks/{task['id']}/logs", params={"limit": 1000}).json()
            if line["text"].startswith("probe ")
        }
    )
    hosts = {
        (a["resource_group"], a["host"])
        for a in api.get(f"/tasks/{task['id']}/allocations").json()
        if a["role"] == "compute"
    }
    print(
        json.dumps(
            {
                "script": "netns_cluster",
                "status": done["status"],
                "status_reason": done["status_reason"],
                "master_addr": done.get("master_addr"),
                "compute_hosts": sorted(hosts),
                "probes": probes,
                "control_probe": control_probe(),
                "wall_s": round(time.monotonic() - started, 1),
            }
        )
    )
    ok = (
        done["status"] == "SUCCEEDED"
        and hosts == {("cpu-a", addr_a), ("cpu-b", addr_b)}
        and done.get("master_addr") == addr_a
    )
    return 0 if ok else 1


def main(url: str, email: str, password: str, addr_a: str, addr_b: str, step: str) -> int:
    api = client(url, email, password)
    if step == "groups":
        create_groups(api)
        return 0
    return run_task(api, addr_a, addr_b)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:7]))
