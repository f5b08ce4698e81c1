"""Heterogeneity options at submission: stored in the spec, refused with the field named.

Also the throughput read model: per worker and per group, from reported metrics.
"""

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.scheduler.service import schedule_once
from contracts.task_spec import TaskSpec
from tests.backend import scheduling
from tests.conftest import agent_headers, make_group, make_project, register_agent, task_request


@pytest.fixture
def version(client: TestClient) -> dict:
    make_group(client, "cpu-a", 2)
    make_group(client, "cpu-b", 1)
    return make_project(client)[1]


def test_heterogeneity_options_reach_the_task_spec(client: TestClient, version: dict) -> None:
    groups = [
        {"name": "cpu-a", "workers": 2},
        {"name": "cpu-b", "workers": 1, "speed_factor": 0.25},
    ]
    steps = [{"op": "resize", "size": [14, 14]}, {"op": "normalize"}]
    response = client.post(
        "/api/v1/tasks",
        json=task_request(
            version,
            resource_groups=groups,
            split_policy="weighted",
            sync_strategy="quorum",
            quorum=1,
            max_staleness=3,
            exchange_fraction=0.1,
            checkpoint_every=50,
            preprocess=steps,
            on_nonfinite="skip_step",
            on_disagreement="exclude",
            agreement_every=25,
            agreement_tolerance={"cuda/cpu": 1e-3},
            data={"path": "streaming", "num_workers": 2, "prefetch_factor": 4},
        ),
    )
    assert response.status_code == 201, response.text
    spec = response.json()["spec"]
    assert (spec["split_policy"], spec["sync_strategy"], spec["quorum"]) == (
        "weighted",
        "quorum",
        1,
    )
    assert (spec["max_staleness"], spec["exchange_fraction"], spec["checkpoint_every"]) == (
        3,
        0.1,
        50,
    )
    assert [s["op"] for s in spec["preprocess"]] == ["resize", "normalize"]
    # what the agents receive
    engine = TaskSpec.model_validate(spec).engine_options()
    assert engine["on_nonfinite"] == "skip_step"
    assert (engine["on_disagreement"], engine["agreement_every"]) == ("exclude", 25)
    assert engine["agreement_tolerance"] == {"cpu/cuda": 1e-3}
    assert engine["data"] == {
        "path": "streaming",
        "num_workers": 2,
        "prefetch_factor": 4,
        "persistent_workers": True,
        "pin_memory": None,
    }
    assert spec["request"][1]["speed_factor"] == 0.25


def test_diloco_options_reach_the_spec_with_a_round_of_16_by_default(
    client: TestClient, version: dict
) -> None:
    body = task_request(version, sync_strategy="diloco", diloco_exchange="overlapped")
    spec = client.post("/api/v1/tasks", json=body).json()["spec"]
    assert (spec["sync_strategy"], spec["sync_period"]) == ("diloco", 16)
    assert spec["diloco_exchange"] == "overlapped" and spec["outer_lr"] is None
    assert spec["rebalance_every"] == 0  # a check mid-epoch would make every group wait
    body = task_request(version, sync_strategy="diloco", sync_period=40, outer_momentum=0.0)
    spec = client.post("/api/v1/tasks", json=body).json()["spec"]
    assert (spec["sync_period"], spec["outer_momentum"]) == (40, 0.0)
    assert spec["rebalance_every"] == 10  # blocking keeps the default checks
    body = task_request(version, sync_strategy="diloco", diloco_exchange="async", rebalance_every=5)
    assert client.post("/api/v1/tasks", json=body).json()["spec"]["rebalance_every"] == 5


def test_sharding_reaches_the_spec_per_task_and_per_group(
    client: TestClient, version: dict
) -> None:
    groups = [
        {"name": "cpu-a", "workers": 2},
        {"name": "cpu-b", "workers": 1, "sharding": "none"},
    ]
    body = task_request(
        version,
        resource_groups=groups,
        sharding="fsdp",
        fsdp_units=["Net", "Linear"],
        fsdp_param_dtype="bfloat16",
    )
    response = client.post("/api/v1/tasks", json=body)
    assert response.status_code == 201, response.text
    spec = response.json()["spec"]
    assert (spec["sharding"], spec["fsdp_units"]) == ("fsdp", ["Net", "Linear"])
    assert spec["fsdp_param_dtype"] == "bfloat16"
    assert "sharding" not in spec["request"][0] and spec["request"][1]["sharding"] == "none"
    stored = TaskSpec.model_validate(spec)
    assert [stored.sharding_of(g) for g in stored.groups] == [None, "none"]  # None: the task's
    engine = stored.engine_options()
    assert (engine["sharding"], engine["fsdp_units"]) == ("fsdp", ["Net", "Linear"])
    assert engine["fsdp_param_dtype"] == "bfloat16"

    # A group's own, with the task's left at none; and a device-type item's own.
    groups = [
        {"name": "cpu-a", "workers": 2, "sharding": "fsdp"},
        {"name": "cpu-b", "workers": 1, "speed_factor": 0.5},
    ]
    own = client.post("/api/v1/tasks", json=task_request(version, resource_groups=groups)).json()
    spec = own["spec"]
    assert (spec["sharding"], spec["fsdp_units"]) == ("none", [])
    assert spec["request"][0]["sharding"] == "fsdp" and "sharding" not in spec["request"][1]
    device = [{"device_type": "cpu", "workers": 2, "sharding": "fsdp"}]
    spec = client.post("/api/v1/tasks", json=task_request(version, resource_groups=device))
    assert spec.json()["spec"]["request"][0]["sharding"] == "fsdp"

    # A retry keeps each item's own settings.
    client.post(f"/api/v1/tasks/{own['id']}/cancel")
    retried = client.post(f"/api/v1/tasks/{own['id']}/retry")
    assert retried.status_code == 201, retried.text
    request = retried.json()["spec"]["request"]
    assert (request[0]["sharding"], request[1]["speed_factor"]) == ("fsdp", 0.5)


@pytest.mark.parametrize(
    "request_items,groups",
    [
        (
            [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 2, "sharding": "none"}],
            [("cpu-a", None), ("cpu-b", "none")],
        ),
        ([{"device_type": "cpu", "workers": 2, "sharding": "fsdp"}], [("cpu-a", "fsdp")]),
    ],
)
def test_each_groups_sharding_reaches_the_agents(
    session: Session, request_items: list[dict], groups: list[tuple]
) -> None:
    scheduling.group(session, "cpu-a", 2)
    scheduling.group(session, "cpu-b", 2)
    code = scheduling.version(session)
    scheduling.submit(session, code, request_items, sharding="fsdp", fsdp_units=["Linear"])
    dispatcher = scheduling.RecordingDispatcher()
    assert schedule_once(session, dispatcher, heartbeat_timeout_s=15) == 1
    assert dispatcher.sent
    for payload in dispatcher.sent:
        assert [(g.name, g.sharding) for g in payload.groups] == groups
        assert (payload.engine["sharding"], payload.engine["fsdp_units"]) == ("fsdp", ["Linear"])


def test_max_local_batch_reaches_the_spec_and_a_retry_keeps_it(
    client: TestClient, version: dict
) -> None:
    groups = [
        {"name": "cpu-a", "workers": 2, "max_local_batch": 12},
        {"name": "cpu-b", "workers": 1, "speed_factor": 0.5},
    ]
    body = task_request(version, resource_groups=groups, split_policy="weighted")
    response = client.post("/api/v1/tasks", json=body)
    assert response.status_code == 201, response.text
    task = response.json()
    request = task["spec"]["request"]
    assert request[0]["max_local_batch"] == 12 and "max_local_batch" not in request[1]
    stored = TaskSpec.model_validate(task["spec"])
    assert [stored.max_local_batch_of(g) for g in stored.groups] == [12, None]
    device = [{"device_type": "cpu", "workers": 3, "max_local_batch": 11}]
    spec = client.post("/api/v1/tasks", json=task_request(version, resource_groups=device))
    assert spec.status_code == 201, spec.text  # even: 11 a worker, within the cap
    assert spec.json()["spec"]["request"][0]["max_local_batch"] == 11

    client.post(f"/api/v1/tasks/{task['id']}/cancel")
    retried = client.post(f"/api/v1/tasks/{task['id']}/retry")
    assert retried.status_code == 201, retried.text
    request = retried.json()["spec"]["request"]
    assert (request[0]["max_local_batch"], request[1]["speed_factor"]) == (12, 0.5)


@pytest.mark.parametrize(
    "request_items,groups",
    [
        (
            [
                {"name": "cpu-a", "workers": 2, "max_local_batch": 20},
                {"name": "cpu-b", "workers": 2},
            ],
            [("cpu-a", 20), ("cpu-b", None)],
        ),
        ([{"device_type": "cpu", "workers": 2, "max_local_batch": 40}], [("cpu-a", 40)]),
    ],
)
def test_each_groups_max_local_batch_reaches_the_agents(
    session: Session, request_items: list[dict], groups: list[tuple]
) -> None:
    scheduling.group(session, "cpu-a", 2)
    scheduling.group(session, "cpu-b", 2)
    code = scheduling.version(session)
    scheduling.submit(session, code, request_items, split_policy="weighted")
    dispatcher = scheduling.RecordingDispatcher()
    assert schedule_once(session, dispatcher, heartbeat_timeout_s=15) == 1
    assert dispatcher.sent
    for payload in dispatcher.sent:
        assert [(g.name, g.max_local_batch) for g in payload.groups] == groups


def test_defaults_are_even_synchronous(client: TestClient, version: dict) -> None:
    spec = client.post("/api/v1/tasks", json=task_request(version)).json()["spec"]
    assert (spec["split_policy"], spec["sync_strategy"], spec["exchange_fraction"]) == (
        "even",
        "sync",
        0.0,
    )
    assert spec["on_nonfinite"] == "fail"


@pytest.mark.parametrize(
    "overrides,field,words",
    [
        (
            {"resource_groups": [{"name": "cpu-a", "workers": 2, "speed_factor": 0}]},
            "resource_groups.0.speed_factor",
            "greater than 0",
        ),
        (
            {
                "resource_groups": [
                    {"name": "cpu-a", "workers": 2},
                    {"name": "cpu-b", "workers": 1, "speed_factor": 1.5},
                ]
            },
            "resource_groups.1.speed_factor",
            "less than or equal to 1",
        ),
        ({"exchange_fraction": 1.5}, "exchange_fraction", "less than or equal to 1"),
        ({"exchange_fraction": -0.2}, "exchange_fraction", "greater than or equal to 0"),
        (
            {"sync_strategy": "quorum", "quorum": 3},
            "quorum",
            "larger than the number of groups (2)",
        ),
        ({"quorum": 1}, "quorum", "sync_strategy 'quorum'"),
        ({"global_batch_size": 2}, "global_batch_size", "smaller than the number of workers (3)"),
        ({"sync_period": 5}, "sync_period", "sync_strategy 'periodic' or 'diloco'"),
        ({"sync_strategy": "diloco", "sync_period": 0}, "sync_period", "greater than or equal"),
        ({"sync_strategy": "diloco", "sync_period": 1}, "sync_period", "diloco round needs 2"),
        ({"diloco_exchange": "overlapped"}, "diloco_exchange", "sync_strategy 'diloco' only"),
        (
            {"sync_strategy": "quorum", "ps_shards": 2},
            "ps_shards",
            "runs with sync_strategy 'sync' or 'periodic' or 'diloco' only",
        ),
        (
            {"sync_strategy": "quorum", "ps_shards": 3},
            "ps_shards",
            "not 'quorum' (use ps_shards 1)",
        ),
        (
            {"sync_strategy": "diloco", "diloco_exchange": "async", "ps_shards": 2},
            "ps_shards",
            "not 'async' (use ps_shards 1)",
        ),
        ({"sync_strategy": "periodic", "ps_shards": 0}, "ps_shards", "greater than or equal to 1"),
        ({"sync_strategy": "periodic", "ps_shards": 17}, "ps_shards", "less than or equal to 16"),
        (
            {"sync_strategy": "diloco", "diloco_exchange": "gossip"},
            "diloco_exchange",
            "'blocking', 'overlapped' or 'async'",
        ),
        (
            {
                "sync_strategy": "diloco",
                "diloco_exchange": "async",
                "resource_groups": [{"name": "cpu-a", "workers": 2}],
            },
            "diloco_exchange",
            "'async' needs two or more resource groups",
        ),
        ({"sync_strategy": "diloco", "outer_momentum": 1.0}, "outer_momentum", "less than 1"),
        ({"sync_strategy": "diloco", "outer_momentum": -0.1}, "outer_momentum", "greater than"),
        ({"sync_strategy": "diloco", "outer_lr": 0}, "outer_lr", "greater than 0"),
        ({"outer_lr": 0.5}, "outer_lr", "outer_lr applies to sync_strategy 'diloco' only"),
        ({"split_policy": "fastest"}, "split_policy", "'even' or 'weighted'"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite", "'fail' or 'skip_step'"),
        ({"on_disagreement": "warn"}, "on_disagreement", "'fail', 'exclude' or 'off'"),
        ({"agreement_every": -1}, "agreement_every", "greater than or equal to 0"),
        ({"agreement_tolerance": {"cpu+cuda": 0.1}}, "agreement_tolerance", "'cpu/cuda'"),
        ({"agreement_tolerance": {"cpu/cuda": 2}}, "agreement_tolerance.cpu/cuda", "less than"),
        ({"preprocess": [{"op": "rotate"}]}, "preprocess.0", "tag"),
        ({"preprocess": [{"op": "resize", "size": [0, 4]}]}, "preprocess.0.resize", "positive"),
        ({"split": "weighted"}, "split", "unknown field"),
        ({"data": {"path": "disk"}}, "data.path", "'auto', 'memory' or 'streaming'"),
        ({"data": {"num_workers": 65}}, "data.num_workers", "less than or equal to 64"),
        ({"data": {"workers": 2}}, "data.workers", "unknown field"),
        (
            {"resource_groups": [{"name": "cpu-a", "workers": 2, "speed": 0.5}]},
            "resource_groups.0.speed",
            "unknown field",
        ),
        (
            {"preprocess": [{"op": "augment", "copies": 2, "flip": True}]},
            "preprocess.0.augment.flip",
            "unknown field",
        ),
        ({"sharding": "fsdp"}, "sharding", "resource_groups.1 (cpu-b) has 1: there is nothing"),
        (
            {
                "resource_groups": [
                    {"name": "cpu-a", "workers": 2},
                    {"name": "cpu-b", "workers": 1, "sharding": "fsdp"},
                ]
            },
            "resource_groups.1.sharding",
            "'fsdp' needs 2 or more workers in the group",
        ),
        (
            {"resource_groups": [{"device_type": "cpu", "workers": 1, "sharding": "fsdp"}]},
            "resource_groups.0.sharding",
            "nothing to shard",
        ),
        (
            {"sharding": "fsdp", "resource_groups": [{"device_type": "cpu", "workers": 1}]},
            "sharding",
            "resource_groups.0 (cpu) has 1",
        ),
        (
            {
                "sharding": "fsdp",
                "sync_strategy": "quorum",
                "resource_groups": [{"name": "cpu-a", "workers": 2}],
            },
            "sharding",
            "sync_strategy 'sync', 'periodic', 'diloco', not 'quorum'",
        ),
        (
            {
                "sharding": "fsdp",
                "sync_strategy": "diloco",
                "diloco_exchange": "async",
                "resource_groups": [{"name": "a", "workers": 2}, {"name": "b", "workers": 2}],
            },
            "sharding",
            "runs with diloco_exchange 'blocking' or 'overlapped', not 'async'",
        ),
        (
            {
                "sync_strategy": "quorum",
                "resource_groups": [{"name": "cpu-a", "workers": 2, "sharding": "fsdp"}],
            },
            "sync_strategy",
            "'quorum' does not run sharded groups (resource_groups.0 has sharding 'fsdp'",
        ),
        (
            {
                "sync_strategy": "diloco",
                "diloco_exchange": "async",
                "resource_groups": [
                    {"name": "a", "workers": 2, "sharding": "fsdp"},
                    {"name": "b", "workers": 1},
                ],
            },
            "diloco_exchange",
            "'async' does not run sharded groups (resource_groups.0 has sharding 'fsdp'",
        ),
        ({"fsdp_units": ["Block"]}, "fsdp_units", "applies only where a group has sharding"),
        (
            {"fsdp_param_dtype": "bfloat16"},
            "fsdp_param_dtype",
            "fsdp_param_dtype applies only where a group has sharding 'fsdp'",
        ),
        (
            {
                "sharding": "fsdp",
                "fsdp_param_dtype": "float16",
                "resource_groups": [{"name": "cpu-a", "workers": 2}],
            },
            "fsdp_param_dtype",
            "Input should be 'float32' or 'bfloat16'",
        ),
        (
            {
                "sharding": "fsdp",
                "fsdp_units": ["Block"],
                "resource_groups": [
                    {"name": "cpu-a", "workers": 2, "sharding": "none"},
                    {"name": "cpu-b", "workers": 1, "sharding": "none"},
                ],
            },
            "fsdp_units",
            "applies only where a group has sharding 'fsdp'",
        ),
        (
            {
                "sharding": "fsdp",
                "resource_groups": [{"name": "cpu-a", "workers": 2}],
                "fsdp_units": ["Block", "nn.Linear"],
            },
            "fsdp_units.1",
            "'nn.Linear' is not a class name",
        ),
        (
            {
                "sharding": "fsdp",
                "resource_groups": [{"name": "cpu-a", "workers": 2}],
                "fsdp_units": ["Block"] * 33,
            },
            "fsdp_units",
            "at most 32 items",
        ),
        (
            {"resource_groups": [{"name": "cpu-a", "workers": 2, "max_local_batch": 0}]},
            "resource_groups.0.max_local_batch",
            "greater than or equal to 1",
        ),
        (
            {
                "split_policy": "weighted",
                "resource_groups": [
                    {"name": "cpu-a", "workers": 2, "max_local_batch": 10},
                    {"name": "cpu-b", "workers": 1, "max_local_batch": 10},
                ],
            },
            "global_batch_size",
            "max_local_batch lets the groups take at most 30 samples a step (workers × "
            "max_local_batch: resource_groups.0 (cpu-a) 2 × 10; resource_groups.1 (cpu-b) "
            "1 × 10), fewer than global_batch_size 32",
        ),
        (
            {
                "split_policy": "weighted",
                "resource_groups": [{"device_type": "cpu", "workers": 2, "max_local_batch": 10}],
            },
            "global_batch_size",
            "at most 20 samples a step (workers × max_local_batch: resource_groups.0 (cpu) 2 × 10)",
        ),
        (
            {
                "resource_groups": [
                    {"name": "cpu-a", "workers": 2},
                    {"name": "cpu-b", "workers": 1, "max_local_batch": 8},
                ]
            },
            "split_policy",
            "'even' gives each worker up to 11 samples a step (global_batch_size 32 over 3 "
            "workers), more than the max_local_batch 8 of resource_groups.1 (cpu-b): use "
            "split_policy 'weighted'",
        ),
        ({"sharding": "zero3"}, "sharding", "'none' or 'fsdp'"),
        (
            {"resource_groups": [{"name": "cpu-a", "workers": 2, "sharding": "full"}]},
            "resource_groups.0.sharding",
            "'none' or 'fsdp'",
        ),
        ({"name": "run\x00one"}, "name", "must not contain NUL"),
        (
            {
                "resource_groups": [
                    {"device_type": "cpu", "workers": 2, "labels": {"zone\x00": "a"}}
                ]
            },
            "resource_groups.0.labels",
            "must not contain NUL",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_field(
    client: TestClient, version: dict, overrides: dict, field: str, words: str
) -> None:
    response = client.post("/api/v1/tasks", json=task_request(version, **overrides))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    assert words in error["message"] and error["message"].startswith(field)
    assert client.get("/api/v1/tasks").json() == []


def test_loader_processes_beyond_a_hosts_cores_are_refused(
    client: TestClient, version: dict
) -> None:
    hardware = {"cpu_cores": 4, "memory_bytes": 2**33}
    assert register_agent(client, "cpu-a", hardware).status_code == 200
    response = client.post("/api/v1/tasks", json=task_request(version, data={"num_workers": 5}))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "data.num_workers"
    assert "agent 'a1' of resource group 'cpu-a' has 4 cores" in error["message"]
    assert client.get("/api/v1/tasks").json() == []
    fits = client.post("/api/v1/tasks", json=task_request(version, data={"num_workers": 4}))
    assert fits.status_code == 201, fits.text


def test_throughput_per_worker_and_group(client: TestClient, version: dict) -> None:
    task = client.post("/api/v1/tasks", json=task_request(version)).json()
    reported = [
        ("profiled_samples_per_s", 1, 300.0),
        ("profiled_samples_per_s", 2, 280.0),
        ("profiled_samples_per_s", 3, 100.0),
        ("samples_per_s", 1, 90.0),
        ("samples_per_s", 1, 310.0),
        ("samples_per_s", 3, 95.0),
        ("batch_share", 1, 0.4),
        ("batch_share", 2, 0.4),
        ("batch_share", 3, 0.2),
        ("idle_fraction", 1, 0.02),
        ("idle_fraction", 2, 0.06),
        ("samples_per_s", None, 640.0),
    ]
    batch = {
        "metrics": [
            {"name": n, "rank": r, "value": v, "epoch": 0, "step": 5} for n, r, v in reported
        ]
    }
    sent = client.post(
        f"/internal/v1/tasks/{task['id']}/metrics", json=batch, headers=agent_headers()
    )
    assert sent.status_code == 204, sent.text
    body = client.get(f"/api/v1/tasks/{task['id']}/throughput").json()
    assert body["samples_per_s"] == 640.0
    assert [(w["rank"], w["group"], w["samples_per_s"]) for w in body["workers"]] == [
        (1, "cpu-a", 310.0),
        (2, "cpu-a", None),
        (3, "cpu-b", 95.0),
    ]
    cpu_a, cpu_b = body["groups"]
    assert (cpu_a["name"], cpu_a["workers"], cpu_a["profiled_samples_per_s"]) == ("cpu-a", 2, 580.0)
    assert cpu_a["batch_share"] == pytest.approx(0.8) and cpu_b["samples_per_s"] == 95.0
    assert [w["idle_fraction"] for w in body["workers"]] == [0.02, 0.06, None]
    assert cpu_a["idle_fraction"] == pytest.approx(0.04), "a group's idle is its workers' mean"
    assert cpu_b["idle_fraction"] is None
