"""The resource-groups page: groups with their use, agents with their heartbeat."""

import json

from fastapi.testclient import TestClient

from tests.backend.web.dom import parse
from tests.conftest import make_group, register_agent


def test_lists_groups_and_agents(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=4)
    make_group(client, "gpu-a100", capacity=8, device_type="cuda")
    hardware = {"cpu_cores": 16, "memory_bytes": 32 * 2**30, "cuda_devices": []}
    registered = register_agent(
        client, "cpu-a", hardware, name="host1-cpu-a", host="host1", workers=3
    )
    assert registered.status_code == 200, registered.text

    page = parse(client.get("/resource-groups").text)
    row = page.find("tr", data_group="cpu-a")
    cells = [td.text() for td in row.find_all("td")]
    assert cells[:9] == ["cpu-a", "cpu", "active", "4", "1", "3", "0", "3", "0"]
    assert page.find("tr", data_group="gpu-a100").find_all("td")[1].text() == "cuda"
    agent = page.by_id("agent-table").find_all("tr")[1]
    agent_cells = [td.text() for td in agent.find_all("td")]
    assert agent_cells[:5] == ["host1-cpu-a", "host1", "cpu-a", "3", "0"]
    assert agent_cells[5].startswith("16 cores · 32.0 GiB")
    assert json.loads(agent.find_all("td")[5].attrs["title"])["cpu_cores"] == 16
    assert agent_cells[6] == "online"
    assert float(agent_cells[7]) < 60


def test_empty_page_says_how_to_start(client: TestClient) -> None:
    page = parse(client.get("/resource-groups").text)
    assert "No resource groups yet." in page.text()
    assert "polytrain agent --resource-group NAME" in page.text()
