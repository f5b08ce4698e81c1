"""Locust users of `bench/api_p99.py`: portal-like clients listing tasks and reading statuses.

Each user makes one request a second, like a portal page polling: the task
list (newest 50) and one task's status, 1 : 2. Each user keeps its own phase
within the second, as separate portals would: locust spawns `spawn_rate`
users at once each second and `constant_pacing` counts from a user's spawn,
so with it every user would fire in the same instant (one burst of 50
requests a second). The client is locust's FastHttpUser (geventhttpclient),
light enough that 50 users do not load the 2-core host the API shares. The
host, the token and the task ids come from the environment of `bench/api_p99.py`.

Beside the portals, when `POLYTRAIN_BENCH_AGENTS` names registered agents, the
writes of a working deployment: `Submitter`s (a task submission every 2 s each)
and `AgentClient`s (one per agent: a heartbeat every 3 s, and every second a
metric batch of 20 values or a progress report for one of the tasks, alternately).
"""

import itertools
import os
import random
import time

import gevent
from locust import FastHttpUser, task

TOKEN = os.environ["POLYTRAIN_BENCH_TOKEN"]
TASK_IDS = [int(i) for i in os.environ["POLYTRAIN_BENCH_TASKS"].split(",")]
AGENT_TOKEN = os.environ.get("POLYTRAIN_BENCH_AGENT_TOKEN", "")
AGENTS = [int(i) for i in os.environ.get("POLYTRAIN_BENCH_AGENTS", "").split(",") if i]
SUBMIT = os.environ.get("POLYTRAIN_BENCH_SUBMIT", "")  # "project_id,code_version_id"
SUBMITTERS = int(os.environ.get("POLYTRAIN_BENCH_SUBMITTERS", "0"))
PERIOD_S = 1.0


class Paced(FastHttpUser):
    """A user with its own phase, one request every `period_s` from its first."""

    abstract = True
    period_s = PERIOD_S

    def on_start(self) -> None:
        """Wait a random fraction of the period: this user's phase."""
        gevent.sleep(random.uniform(0, self.period_s))
        self.due = time.perf_counter()

    def wait_time(self) -> float:
        """Constant pacing from this user's first request (one request per period)."""
        self.due += self.period_s
        return max(0.0, self.due - time.perf_counter())


class PortalClient(Paced):
    auth = {"Authorization": f"Bearer {TOKEN}"}

    @task(1)
    def list_tasks(self) -> None:
        self.client.get("/api/v1/tasks?limit=50", name="GET /api/v1/tasks", headers=self.auth)

    @task(2)
    def task_status(self) -> None:
        self.client.get(
            f"/api/v1/tasks/{random.choice(TASK_IDS)}",
            headers=self.auth,
            name="GET /api/v1/tasks/{id}",
        )


class Submitter(Paced):
    """A user submitting a task every 2 s (POST /api/v1/tasks)."""

    # Without writers the class must be abstract: locust treats a fixed_count of 0 as
    # unset and gives the class a weight's share of the users (a readers-only run then
    # had 17 portal users of 50, and 33 users failing to submit or report).
    abstract = not (SUBMIT and SUBMITTERS)
    fixed_count = SUBMITTERS
    period_s = 2.0
    auth = {"Authorization": f"Bearer {TOKEN}"}

    @task
    def submit(self) -> None:
        project_id, version_id = (int(i) for i in SUBMIT.split(","))
        self.client.post(
            "/api/v1/tasks",
            json={
                "project_id": project_id,
                "code_version_id": version_id,
                "epochs": 1,
                "resource_groups": [{"name": "cpu-a", "workers": 1}],
                "global_batch_size": 8,
            },
            headers=self.auth,
            name="POST /api/v1/tasks",
        )


class AgentClient(Paced):
    """One registered agent: a heartbeat every 3 s, and each second a metric batch or a
    progress report for one of the tasks (the agent API, with the agent token)."""

    abstract = not AGENTS  # as Submitter's
    fixed_count = len(AGENTS)
    auth = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    numbering = itertools.count()

    def on_start(self) -> None:
        super().on_start()
        self.agent_id, self.beats = AGENTS[next(self.numbering) % len(AGENTS)], 0

    @task
    def report(self) -> None:
        self.beats += 1
        task_id = random.choice(TASK_IDS)
        if self.beats % 3 == 0:
            self.client.post(
                f"/internal/v1/agents/{self.agent_id}/heartbeat",
                json={"running": []},
                headers=self.auth,
                name="POST /internal/v1/agents/{id}/heartbeat",
            )
        elif self.beats % 2:
            metrics = [
                {"name": "loss", "value": random.random(), "step": self.beats, "rank": rank}
                for rank in range(20)
            ]
            self.client.post(
                f"/internal/v1/tasks/{task_id}/metrics",
                json={"metrics": metrics},
                headers=self.auth,
                name="POST /internal/v1/tasks/{id}/metrics",
            )
        else:
            self.client.post(
                f"/internal/v1/tasks/{task_id}/progress",
                json={"progress": 0.5, "epoch": 1},
                headers=self.auth,
                name="POST /internal/v1/tasks/{id}/progress",
            )
