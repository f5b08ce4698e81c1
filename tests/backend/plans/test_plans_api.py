"""Plans over REST: a plan queues a real trial task on its candidate groups; the trial's
timings (from its parameter server, through the internal API) fit the model; the plan then
predicts every subset and recommends one; a task submitted from it has an ETA before its
first step. Bad input is refused naming the field."""

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from backend.plans import performance, service
from tests.conftest import add_account, agent_headers, make_group, make_project, register_agent

pytestmark = pytest.mark.stack


@pytest.fixture
def version(client: TestClient) -> dict:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    return make_project(client, example="tiny_regression")[1]


def _plan_body(version: dict, **overrides: object) -> dict:
    return {
        "project_id": version["project_id"],
        "code_version_id": version["id"],
        "resource_groups": [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
        "global_batch_size": 64,
        "epochs": 3,
        **overrides,
    }


def _timings(slow_a: float = 0.03) -> dict:
    """A trial's report: cpu-a's workers 10 ms + 2 ms/sample, cpu-b's `slow_a` + 6 ms/sample."""
    sizes = [11, 22, 44]

    def worker(rank: int, group: int, a: float, c: float) -> dict:
        return {
            "rank": rank,
            "group_index": group,
            "batch_sizes": sizes,
            "step_s": [a + c * b for b in sizes],
        }

    return {
        # 1,000 steps an epoch: long enough that the groups' start-up (profiling at the
        # even share, the slow group's included) does not decide which subset is fastest
        "n_train": 64_000,
        "exchange_bytes": 4000,
        "startup_s": 4.0,
        "workers": [
            worker(1, 0, 0.01, 0.002),
            worker(2, 0, 0.01, 0.002),
            worker(3, 1, slow_a, 0.006),
        ],
        "exchanges": [
            {
                "kind": "group_allreduce",
                "group_index": 0,
                "members": 2,
                "bytes": [1000, 4000],
                "seconds": [0.0002, 0.0003],
            },
            {
                "kind": "leaders_allreduce",
                "members": 2,
                "bytes": [1000, 4000],
                "seconds": [0.0004, 0.0006],
            },
        ],
    }


def _with_memory(timings: dict) -> dict:
    """The same report with memory measured: cpu-a's workers need 600 MiB + 2 MiB a sample
    whole and 350 + 2 sharded over the two of them (a sharded step 20 % slower), cpu-b's
    worker 299 + 4 (each whole worker also one step's vector, 4,000 bytes, more)."""
    for worker in timings["workers"]:
        sizes = worker["batch_sizes"]
        if worker["group_index"] == 0:
            worker["peak_mb"] = [600 + 2 * b for b in sizes]
            worker["sharded_peak_mb"] = [350 + 2 * b for b in sizes]
            worker["sharded_step_s"] = [1.2 * s for s in worker["step_s"]]
        else:
            worker["peak_mb"] = [299 + 4 * b for b in sizes]
    return timings


def _ready_with_memory(client: TestClient, plan: dict) -> dict:
    """The plan once its trial reported :func:`_with_memory`'s timings."""
    client.put(
        f"/internal/v1/tasks/{plan['trial_task_id']}/trial",
        headers=agent_headers(),
        json=_with_memory(_timings()),
    ).raise_for_status()
    ready = client.get(f"/api/v1/plans/{plan['id']}").json()
    assert ready["status"] == "ready", ready["error"]
    return ready


def test_a_plan_fits_the_model_into_each_groups_memory(client: TestClient, version: dict) -> None:
    plan = client.post("/api/v1/plans", json=_plan_body(version, memory_limit_mb=512)).json()
    trial = client.get(f"/api/v1/tasks/{plan['trial_task_id']}").json()
    assert trial["spec"]["limits"]["memory_limit_mb"] == 4096  # room to measure it whole
    ready = _ready_with_memory(client, plan)
    both = next(
        o
        for o in ready["options"]
        if o["workers"] == {"cpu-a": 2, "cpu-b": 1} and o["split_policy"] == "weighted"
    )
    # cpu-a cannot hold the model whole (600 + 2 x 32 > 512 MiB): it is planned sharded;
    # cpu-b holds (512 - 299) / 4 = 53 samples a step at most, fewer than the 64 it could get
    assert both["sharding"] == {"cpu-a": "fsdp", "cpu-b": "none"}
    assert both["max_local_batch"] == {"cpu-a": None, "cpu-b": 53}
    assert both["memory_limit_mb"] == {"cpu-a": 512, "cpu-b": 512}
    assert all(both["memory_mb"][g] <= 512 for g in ("cpu-a", "cpu-b"))
    # What "Use this plan" submits for that option: each group's sharding and cap
    option = performance.Prediction(**both)
    groups = [service.group_item(option, n, w) for n, w in option.workers.items()]
    assert groups == [
        {"name": "cpu-a", "workers": 2, "sharding": "fsdp"},
        {"name": "cpu-b", "workers": 1, "sharding": "none", "max_local_batch": 53},
    ]
    assert ready["task_request"]["memory_limit_mb"] == 512  # the recommended one, whichever
    request = {**ready["task_request"], "resource_groups": groups, "split_policy": "weighted"}
    assert client.post("/api/v1/tasks", json=request).status_code == 201
    # a task may raise its limit above the plan's: cpu-a then fits whole
    roomy = {**request, "resource_groups": [{"name": "cpu-a", "workers": 2}]}
    assert client.post("/api/v1/tasks", json={**roomy, "memory_limit_mb": 2048}).status_code == 201

    # The same task with cpu-a whole is refused before it runs, naming the group and the MiB.
    whole = roomy
    refused = client.post("/api/v1/tasks", json=whole)
    assert refused.status_code == 422 and _field(refused) == "memory_limit_mb"
    message = refused.json()["error"]["message"]
    assert "group 'cpu-a' does not fit its memory" in message and "664 MiB whole" in message
    assert "may hold 512 MiB" in message


def _field(response) -> str:  # type: ignore[no-untyped-def]
    """The field the error names (the shared error shape)."""
    return str(response.json()["error"].get("field"))


def test_a_plans_trial_trains_the_model_the_tasks_hyperparameters_build(
    client: TestClient,
) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    mnist = make_project(client, name="mnist-plans", example="mnist_cnn")[1]
    body = _plan_body(mnist, hyperparameters={"hidden": 32})
    created = client.post("/api/v1/plans", json=body)
    assert created.status_code == 201, created.text
    trial = client.get(f"/api/v1/tasks/{created.json()['trial_task_id']}").json()
    assert trial["spec"]["hyperparameters"] == {"hidden": 32}
    before = len(client.get("/api/v1/tasks").json())
    refused = client.post("/api/v1/plans", json={**body, "hyperparameters": {"width": 3}})
    assert refused.status_code == 422 and _field(refused) == "hyperparameters.width"
    assert len(client.get("/api/v1/tasks").json()) == before  # no trial queued


def test_a_plan_runs_a_trial_task_then_recommends(client: TestClient, version: dict) -> None:
    created = client.post("/api/v1/plans", json=_plan_body(version))
    assert created.status_code == 201, created.text
    plan = created.json()
    assert plan["status"] == "trial" and plan["best"] is None
    # The trial is a real task: queued on both candidate groups, visible, one epoch.
    task = client.get(f"/api/v1/tasks/{plan['trial_task_id']}").json()
    assert task["status"] == "QUEUED" and task["name"].startswith("trial: ")
    assert task["spec"]["trial"]["batch_sizes"] == service.trial_batch_sizes(64, 3) == [11, 22, 44]
    assert [g["name"] for g in task["spec"]["groups"]] == ["cpu-a", "cpu-b"]
    assert task["spec"]["epochs"] == 1 and task["max_restarts"] == 0
    listed = client.get("/api/v1/tasks").json()
    assert plan["trial_task_id"] in [t["id"] for t in listed]
    # A diloco group steps at its share of the global batch, 64 / 2 and 64 / 1 here: timed too.
    diloco = client.post("/api/v1/plans", json=_plan_body(version, sync_strategy="diloco"))
    assert diloco.status_code == 201, diloco.text
    trial = client.get(f"/api/v1/tasks/{diloco.json()['trial_task_id']}").json()
    assert trial["spec"]["trial"]["batch_sizes"] == [11, 22, 32, 44, 64]

    stored = client.put(
        f"/internal/v1/tasks/{plan['trial_task_id']}/trial",
        headers=agent_headers(),
        json=_timings(),
    )
    assert stored.status_code == 200 and stored.json() == {"plan_id": plan["id"], "fitted": True}
    ready = client.get(f"/api/v1/plans/{plan['id']}").json()
    assert ready["status"] == "ready"
    # Every subset ({a}, {b}, {a, b}) under both split policies, fastest first.
    assert len(ready["options"]) == 6
    finishes = [o["finish_s"] for o in ready["options"]]
    assert finishes == sorted(finishes)
    best = ready["best"]
    assert best == ready["options"][0]
    assert best["workers"] == {"cpu-a": 2, "cpu-b": 1} and best["split_policy"] == "weighted"
    assert set(ready["marginal_gain_s"]) == {"cpu-a", "cpu-b"}
    assert ready["task_request"]["resource_groups"] == [
        {"name": "cpu-a", "workers": 2},
        {"name": "cpu-b", "workers": 1},
    ]

    # "Use this plan": the task it submits knows its time before its first step.
    submitted = client.post("/api/v1/tasks", json=ready["task_request"])
    assert submitted.status_code == 201, submitted.text
    eta = submitted.json()["eta_s"]
    assert eta == pytest.approx(best["finish_s"], rel=1e-3)
    assert submitted.json()["spec"]["plan_id"] == plan["id"]


def test_a_slow_group_behind_its_exchange_is_left_out_with_the_reason(
    client: TestClient, version: dict
) -> None:
    plan = client.post("/api/v1/plans", json=_plan_body(version)).json()
    client.put(
        f"/internal/v1/tasks/{plan['trial_task_id']}/trial",
        headers=agent_headers(),
        json=_timings(slow_a=0.5),  # cpu-b's fixed cost alone is 25 times cpu-a's step
    ).raise_for_status()
    ready = client.get(f"/api/v1/plans/{plan['id']}").json()
    assert ready["best"]["workers"] == {"cpu-a": 2}
    assert "cpu-b" in ready["left_out"] and "later" in ready["left_out"]["cpu-b"]


def test_deadline_names_the_fewest_workers(client: TestClient, version: dict) -> None:
    deadline = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    plan = client.post("/api/v1/plans", json=_plan_body(version, deadline=deadline)).json()
    client.put(
        f"/internal/v1/tasks/{plan['trial_task_id']}/trial",
        headers=agent_headers(),
        json=_timings(),
    ).raise_for_status()
    ready = client.get(f"/api/v1/plans/{plan['id']}").json()
    assert ready["for_deadline"]["workers"] == {"cpu-a": 1}  # one fast worker makes an hour
    assert ready["task_request"]["resource_groups"] == [{"name": "cpu-a", "workers": 1}]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"resource_groups": []}, "resource_groups"),
        ({"deadline": "2020-01-01T00:00:00Z"}, "deadline"),
        ({"resource_groups": [{"name": "gpu-x", "workers": 1}]}, "resource_groups.0.name"),
        ({"resource_groups": [{"name": "cpu-a", "workers": 3}]}, "resource_groups.0.workers"),
        (
            {"global_batch_size": 1, "resource_groups": [{"name": "cpu-a", "workers": 2}]},
            "global_batch_size",
        ),
    ],
)
def test_bad_plans_are_refused_naming_the_field(
    client: TestClient, version: dict, overrides: dict, field: str
) -> None:
    before = client.get("/api/v1/tasks").json()
    response = client.post("/api/v1/plans", json=_plan_body(version, **overrides))
    assert response.status_code == 422, response.text
    assert _field(response) == field
    assert client.get("/api/v1/tasks").json() == before  # no trial task left behind
    assert client.get("/api/v1/plans").json() == []


def test_cancel_stops_the_trial_and_a_stranger_sees_nothing(
    client: TestClient, version: dict
) -> None:
    plan = client.post("/api/v1/plans", json=_plan_body(version)).json()
    stranger = add_account("stranger@example.org")
    assert client.get(f"/api/v1/plans/{plan['id']}", headers=stranger.headers).status_code == 404
    assert client.get("/api/v1/plans", headers=stranger.headers).json() == []
    cancelled = client.post(f"/api/v1/plans/{plan['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    task = client.get(f"/api/v1/tasks/{plan['trial_task_id']}").json()
    assert task["status"] == "CANCELLED"
    assert client.post(f"/api/v1/plans/{plan['id']}/cancel").status_code == 409
    # A trial is not retried as a task: its timings would belong to no plan.
    retried = client.post(f"/api/v1/tasks/{plan['trial_task_id']}/retry")
    assert retried.status_code == 409 and _field(retried) == "task_id"


def test_trial_timings_for_a_task_that_is_no_trial_are_refused(
    client: TestClient, version: dict
) -> None:
    from tests.conftest import task_request

    task = client.post("/api/v1/tasks", json=task_request(version)).json()
    response = client.put(
        f"/internal/v1/tasks/{task['id']}/trial", headers=agent_headers(), json=_timings()
    )
    assert response.status_code == 404 and _field(response) == "task_id"


def test_a_task_from_an_unfitted_plan_is_refused(client: TestClient, version: dict) -> None:
    plan = client.post("/api/v1/plans", json=_plan_body(version)).json()
    from tests.conftest import task_request

    response = client.post("/api/v1/tasks", json=task_request(version, plan_id=plan["id"]))
    assert response.status_code == 422 and _field(response) == "plan_id"


def test_a_task_of_another_strategy_is_refused_its_plan(client: TestClient, version: dict) -> None:
    from tests.conftest import task_request

    plan = client.post("/api/v1/plans", json=_plan_body(version)).json()  # sync
    client.put(
        f"/internal/v1/tasks/{plan['trial_task_id']}/trial",
        headers=agent_headers(),
        json=_timings(),
    ).raise_for_status()
    body = task_request(version, plan_id=plan["id"], sync_strategy="periodic", sync_period=4)
    response = client.post("/api/v1/tasks", json=body)
    assert response.status_code == 422 and _field(response) == "plan_id"
    assert "sync_strategy 'sync'" in response.json()["error"]["message"]


def test_a_deadline_without_a_zone_is_utc(client: TestClient, version: dict) -> None:
    soon = (datetime.now(UTC) + timedelta(hours=2)).replace(tzinfo=None).isoformat()
    created = client.post("/api/v1/plans", json=_plan_body(version, deadline=soon))
    assert created.status_code == 201, created.text
    assert created.json()["deadline"] == soon[:19] + "Z" or created.json()["deadline"].startswith(
        soon[:19]
    )
    past = (datetime.now(UTC) - timedelta(hours=2)).replace(tzinfo=None).isoformat()
    refused = client.post("/api/v1/plans", json=_plan_body(version, deadline=past))
    assert refused.status_code == 422 and _field(refused) == "deadline"


def test_forged_timings_fail_the_plan_and_reads_still_answer(
    client: TestClient, version: dict
) -> None:
    plan = client.post("/api/v1/plans", json=_plan_body(version)).json()
    forged = _timings()
    forged["exchanges"] = forged["exchanges"][:1]  # no leaders' allreduce for a sync plan
    stored = client.put(
        f"/internal/v1/tasks/{plan['trial_task_id']}/trial", headers=agent_headers(), json=forged
    )
    assert stored.status_code == 200 and stored.json()["fitted"] is False
    read = client.get(f"/api/v1/plans/{plan['id']}").json()
    assert read["status"] == "failed" and "leaders" in read["error"]
    assert client.get("/api/v1/plans").status_code == 200
    huge = _timings()
    huge["workers"][0]["batch_sizes"] = [-5, 10**400]
    refused = client.put(
        f"/internal/v1/tasks/{plan['trial_task_id']}/trial", headers=agent_headers(), json=huge
    )
    assert refused.status_code == 422


def test_a_cpu_groups_agents_bound_what_a_worker_may_hold(
    client: TestClient, version: dict
) -> None:
    # cpu-b's agent has 1.2 GiB of host memory for its 2 workers: 614 MiB a worker, less than
    # the plan's 4,096 MiB limit; cpu-a's agent 64 GiB for 2, so the limit holds there.
    hardware = {"device_type": "cpu", "cpu_cores": 2}
    register_agent(
        client, "cpu-b", {**hardware, "memory_bytes": int(1.2 * 2**30)}, name="b1"
    ).raise_for_status()
    register_agent(
        client, "cpu-a", {**hardware, "memory_bytes": 64 * 2**30}, name="a1"
    ).raise_for_status()
    ready = _ready_with_memory(
        client, client.post("/api/v1/plans", json=_plan_body(version)).json()
    )
    both = [o for o in ready["options"] if set(o["workers"]) == {"cpu-a", "cpu-b"}]
    assert both and all(o["memory_limit_mb"]["cpu-b"] == pytest.approx(614.4) for o in both)
    assert all(o["memory_limit_mb"]["cpu-a"] == 4096 for o in both)
