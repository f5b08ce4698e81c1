"""Groups are homogeneous (issue 19, item 5): an agent whose device type or model differs
from its group's is refused, naming the difference, and nothing changes; the first agent
pins the group's model; an admin widens a group by adding models."""

from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.backend.web.dom import parse
from tests.conftest import agent_headers, make_group, register_agent, with_csrf

pytestmark = pytest.mark.stack
EPYC = "AMD EPYC 7763 64-Core Processor"
XEON = "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz"


def _register(
    client: TestClient, group: str, model: str, *, name: str = "a1", device_type: str = "cpu"
) -> httpx.Response:
    hardware: dict[str, Any] = {
        "device_type": device_type,
        "device_model": model,
        "device_memory_mb": 16384,
        "cpu_cores": 8,
        "memory_bytes": 16 * 2**30,
    }
    return register_agent(client, group, hardware, name=name)


def _error(response: httpx.Response) -> dict[str, str]:
    assert response.status_code == 409, response.text
    return dict(response.json()["error"])


def test_the_first_agent_pins_the_model_and_another_model_is_refused(
    client: TestClient,
) -> None:
    make_group(client, "cpu-a")
    assert client.get("/api/v1/resource-groups/cpu-a").json()["accepted_models"] == []
    first = _register(client, "cpu-a", EPYC)
    assert first.status_code == 200, first.text
    assert first.json()["hardware"]["device_model"] == EPYC
    assert client.get("/api/v1/resource-groups/cpu-a").json()["accepted_models"] == [EPYC]
    assert _register(client, "cpu-a", EPYC, name="a2").status_code == 200

    error = _error(_register(client, "cpu-a", XEON, name="a3"))
    assert error["field"] == "hardware.device_model"
    assert f"'{EPYC}'" in error["message"] and f"add '{XEON}'" in error["message"]
    assert "accepted models" in error["message"]
    names = [agent["name"] for agent in client.get("/api/v1/agents").json()]
    assert names == ["a1", "a2"]  # nothing registered


def test_a_refused_restart_changes_nothing(client: TestClient) -> None:
    make_group(client, "cpu-a")
    assert _register(client, "cpu-a", EPYC).status_code == 200
    client.post(
        f"/internal/v1/agents/{client.get('/api/v1/agents').json()[0]['id']}/deregister",
        headers=agent_headers(),
    )
    _error(_register(client, "cpu-a", XEON))  # the same name, other hardware
    (agent,) = client.get("/api/v1/agents").json()
    assert (agent["online"], agent["hardware"]["device_model"]) == (False, EPYC)
    assert client.get("/api/v1/resource-groups/cpu-a").json()["accepted_models"] == [EPYC]


def test_an_admin_widens_the_group_and_the_agent_is_accepted(client: TestClient) -> None:
    make_group(client, "cpu-a")
    assert _register(client, "cpu-a", EPYC).status_code == 200
    _error(_register(client, "cpu-a", XEON, name="a2"))
    widened = client.patch("/api/v1/resource-groups/cpu-a", json={"accepted_models": [EPYC, XEON]})
    assert widened.status_code == 200 and widened.json()["accepted_models"] == [EPYC, XEON]
    assert _register(client, "cpu-a", XEON, name="a2").status_code == 200
    bad = client.patch("/api/v1/resource-groups/cpu-a", json={"accepted_models": [""]})
    assert bad.status_code == 422 and bad.json()["error"]["field"].startswith("accepted_models")


def test_a_device_type_mismatch_is_refused_naming_both(client: TestClient) -> None:
    make_group(client, "gpu-a", device_type="cuda")
    error = _error(_register(client, "gpu-a", EPYC))  # a host without a usable GPU
    assert error["field"] == "hardware.device_type"
    assert "'gpu-a' is a cuda group" in error["message"] and "hardware is cpu" in error["message"]
    assert "usable GPU" in error["message"]
    assert client.get("/api/v1/agents").json() == []
    assert client.get("/api/v1/resource-groups/gpu-a").json()["accepted_models"] == []

    make_group(client, "cpu-a")
    error = _error(_register(client, "cpu-a", "NVIDIA A100", device_type="cuda"))
    assert error["field"] == "hardware.device_type" and "a cpu group" in error["message"]


def test_a_cuda_group_accepts_its_gpu_model(client: TestClient) -> None:
    make_group(client, "gpu-a", device_type="cuda")
    assert _register(client, "gpu-a", "NVIDIA A100", device_type="cuda").status_code == 200
    assert _error(_register(client, "gpu-a", "NVIDIA V100", name="a2", device_type="cuda"))[
        "field"
    ] == ("hardware.device_model")


def test_a_new_device_type_empties_the_accepted_models(client: TestClient) -> None:
    make_group(client, "g")
    client.patch("/api/v1/resource-groups/g", json={"accepted_models": [EPYC]})
    changed = client.patch("/api/v1/resource-groups/g", json={"device_type": "cuda"}).json()
    assert (changed["device_type"], changed["accepted_models"]) == ("cuda", [])


def test_the_agent_learns_its_groups_device_type(client: TestClient) -> None:
    make_group(client, "gpu-a", device_type="cuda")
    answer = client.get("/internal/v1/resource-groups/gpu-a", headers=agent_headers())
    assert answer.json() == {"name": "gpu-a", "device_type": "cuda", "accepted_models": []}
    missing = client.get("/internal/v1/resource-groups/nope", headers=agent_headers())
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "name"


def test_the_admin_page_edits_the_accepted_models(client: TestClient) -> None:
    make_group(client, "cpu-a")
    assert _register(client, "cpu-a", EPYC).status_code == 200
    page = parse(client.get("/resource-groups").text)
    assert EPYC in page.find("tr", data_group="cpu-a").find(data_models="").text()
    form = {"capacity": "2", "labels": "", "accepted_models": f"{EPYC}\n{XEON}\n"}
    edited = client.post(
        "/resource-groups/cpu-a/edit",
        data=with_csrf(client, form),
        follow_redirects=False,
    )
    assert edited.status_code == 303, edited.text
    assert client.get("/api/v1/resource-groups/cpu-a").json()["accepted_models"] == [EPYC, XEON]
