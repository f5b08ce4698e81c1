"""Editing, archiving and sharing projects; the cluster's admin actions; retrying a task."""

from fastapi.testclient import TestClient

from backend.core.db import get_sessionmaker
from backend.tasks import service as tasks
from tests.backend.web.dom import parse
from tests.conftest import (
    add_account,
    login_as,
    make_group,
    make_project,
    register_agent,
    with_csrf,
)


def _as(client: TestClient, email: str) -> TestClient:
    return login_as(TestClient(client.app), add_account(email))


def test_owner_edits_archives_and_unarchives_a_project(client: TestClient) -> None:
    project, _ = make_project(client)
    url = f"/projects/{project['id']}"
    edited = client.post(
        f"{url}/edit", data=with_csrf(client, {"name": "numerals", "description": "small CNN"})
    )
    assert parse(edited.text).find("h1").text().startswith("numerals")
    bad = client.post(f"{url}/edit", data=with_csrf(client, {"name": "", "description": ""}))
    assert bad.status_code == 422 and parse(bad.text).find(data_field="name")
    archived = parse(
        client.post(f"{url}/archive", data=with_csrf(client, {"archived": "true"})).text
    )
    assert archived.by_id("archived-tag").text() == "archived"
    assert "disabled" in archived.find("button", type="submit", class_="button primary").attrs
    refused = client.post(f"{url}/code-versions", data=with_csrf(client, {"example": "mnist_cnn"}))
    assert refused.status_code == 409 and "archived" in refused.text
    assert "numerals" not in client.get("/projects").text
    assert "numerals" in client.get("/projects?archived=true").text
    client.post(f"{url}/archive", data=with_csrf(client, {"archived": "false"}))
    assert client.get(f"/api/v1/projects/{project['id']}").json()["archived_at"] is None


def test_sharing_a_project_lets_a_member_in(client: TestClient) -> None:
    project, _ = make_project(client)
    bob = _as(client, "bob@example.org")
    assert bob.get(f"/projects/{project['id']}").status_code == 404
    answers = [
        client.post(
            f"/projects/{project['id']}/members",
            follow_redirects=False,
            data=with_csrf(client, {"email": email}),
        )
        for email in ("nobody@example.org", "bob@example.org")
    ]
    # An unknown email is answered like a known one: sharing tells nobody who has an account.
    assert [a.status_code for a in answers] == [303, 303]
    assert [a.headers["location"] for a in answers] == [f"/projects/{project['id']}"] * 2
    flashes = [
        a.cookies["polytrain_flash"].replace("nobody", "X").replace("bob", "X") for a in answers
    ]
    assert flashes[0] == flashes[1]
    page = parse(bob.get(f"/projects/{project['id']}").text)
    assert page.find("li", data_member="bob@example.org")
    assert not page.find_all("form", id="archive-form")  # members do not manage
    assert (
        bob.post(
            f"/projects/{project['id']}/archive", data=with_csrf(bob, {"archived": "true"})
        ).status_code
        == 403
    )


def test_submitting_an_example_adds_its_version_only_with_the_task(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=1)
    project = client.post("/api/v1/projects", json={"name": "p"}).json()
    url = f"/projects/{project['id']}/tasks"
    form = {
        "code_version_id": "example:tiny_regression",
        "epochs": "1",
        "global_batch_size": "8",
        "group": ["cpu-a"],
        "workers": ["5"],
    }
    refused = client.post(url, data=with_csrf(client, form))
    assert refused.status_code == 422
    assert client.get(f"/api/v1/projects/{project['id']}/code-versions").json() == []
    ok = client.post(
        url, data=with_csrf(client, {**form, "workers": ["1"]}), follow_redirects=False
    )
    assert ok.status_code == 303
    versions = client.get(f"/api/v1/projects/{project['id']}/code-versions").json()
    assert [v["source"] for v in versions] == ["example:tiny_regression"]


def test_dependencies_are_offered_and_kept(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=1)
    project, version = make_project(client)
    first = client.post(
        "/api/v1/tasks",
        json={
            "project_id": project["id"],
            "code_version_id": version["id"],
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    ).json()
    page = parse(client.get(f"/projects/{project['id']}").text)
    assert page.by_id("task-depends-on").find("option", value=str(first["id"]))
    client.post(
        f"/projects/{project['id']}/tasks",
        data=with_csrf(
            client,
            {
                "code_version_id": str(version["id"]),
                "group": ["cpu-a"],
                "workers": ["1"],
                "depends_on": [str(first["id"])],
            },
        ),
    )
    newest = client.get("/api/v1/tasks").json()[0]
    assert newest["id"] != first["id"] and newest["waiting"] is True


def test_admin_drains_edits_and_deletes_a_group(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    drained = client.post(
        "/resource-groups/cpu-a/state", data=with_csrf(client, {"state": "draining"})
    )
    assert parse(drained.text).find("tr", data_group="cpu-a").find(data_state="draining")
    edited = client.post(
        "/resource-groups/cpu-a/edit",
        data=with_csrf(
            client, {"capacity": "4", "description": "bigger", "labels": "zone=a, model=xeon"}
        ),
    )
    assert edited.status_code == 200
    group = client.get("/api/v1/resource-groups/cpu-a").json()
    assert (group["capacity"], group["labels"]) == (4, {"zone": "a", "model": "xeon"})
    bad = client.post(
        "/resource-groups/cpu-a/edit", data=with_csrf(client, {"capacity": "0", "labels": "oops"})
    )
    assert bad.status_code == 422 and parse(bad.text).find(data_field="group.cpu-a")
    created = client.post(
        "/resource-groups",
        data=with_csrf(client, {"name": "gpu-a", "device_type": "cuda", "capacity": "8"}),
        follow_redirects=False,
    )
    assert created.status_code == 303
    client.post("/resource-groups/gpu-a/delete", data=with_csrf(client, {}))
    names = [g["name"] for g in client.get("/api/v1/resource-groups").json()]
    assert names == ["cpu-a"]


def test_admin_drains_describes_and_disables_an_agent(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=4)
    hardware = {"cpu_cores": 4, "memory_bytes": 2**33, "cuda_devices": []}
    agent = register_agent(
        client, "cpu-a", hardware, name="host1-cpu-a", host="host1", workers=2
    ).json()
    url = f"/resource-groups/agents/{agent['id']}"
    drained = parse(client.post(f"{url}/state", data=with_csrf(client, {"state": "draining"})).text)
    row = drained.find("tr", data_agent="host1-cpu-a")
    assert row.find(data_state="draining") and row.find(data_action="disabled")
    assert drained.find("tr", data_group="cpu-a").find_all("td")[7].text() == "0"  # free
    client.post(f"{url}/edit", data=with_csrf(client, {"description": "rack 3, loud fan"}))
    bad = client.post(f"{url}/state", data=with_csrf(client, {"state": "asleep"}))
    assert bad.status_code == 422 and parse(bad.text).find(data_field="agent.host1-cpu-a")
    client.post(f"{url}/state", data=with_csrf(client, {"state": "disabled"}))
    read = client.get(f"/api/v1/agents/{agent['id']}").json()
    assert (read["state"], read["description"]) == ("disabled", "rack 3, loud fan")
    bob = _as(client, "bob@example.org")
    refused = bob.post(f"{url}/state", data=with_csrf(bob, {"state": "active"}))
    assert refused.status_code == 403
    assert client.get(f"/api/v1/agents/{agent['id']}").json()["state"] == "disabled"


def test_members_see_the_cluster_but_cannot_change_it(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    bob = _as(client, "bob@example.org")
    page = parse(bob.get("/resource-groups").text)
    assert page.find("tr", data_group="cpu-a") and not page.find_all(data_action="draining")
    refused = bob.post("/resource-groups/cpu-a/state", data=with_csrf(bob, {"state": "draining"}))
    assert refused.status_code == 403
    assert client.get("/api/v1/resource-groups/cpu-a").json()["state"] == "active"


def test_retry_submits_a_copy_of_an_ended_task(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=1)
    project, version = make_project(client)
    task = client.post(
        "/api/v1/tasks",
        json={
            "project_id": project["id"],
            "code_version_id": version["id"],
            "epochs": 2,
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    ).json()
    early = client.post(f"/tasks/{task['id']}/retry", data=with_csrf(client, {}))
    assert (
        "only an ended task is retried" in parse(early.text).find(class_="flash flash-error").text()
    )
    with get_sessionmaker()() as session:
        tasks.cancel(session, task=tasks.get(session, task_id=task["id"]))
    page = parse(client.get(f"/tasks/{task['id']}").text)
    assert "hidden" not in page.by_id("retry-form").attrs
    retried = client.post(
        f"/tasks/{task['id']}/retry", data=with_csrf(client, {}), follow_redirects=False
    )
    copy_id = int(retried.headers["location"].rsplit("/", 1)[1])
    copy = client.get(f"/api/v1/tasks/{copy_id}").json()
    assert copy["status"] == "QUEUED" and copy["spec"]["epochs"] == 2
    assert copy["name"].endswith(f"(retry of {task['id']})")
