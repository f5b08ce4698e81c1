"""Locust users of `bench/api_p99.py`: portal-like clients listing tasks and reading statuses.

Each user makes one request a second, like a portal page polling: the task
list (newest 50) and one task's status, 1 : 2. Each user keeps its own phase
within the second, as separate portals would: locust spawns `spawn_rate`
users at once each second and `constant_pacing` counts from a user's spawn,
so with it every user would fire in the same instant (one burst of 50
requests a second). The client is locust's FastHttpUser (geventhttpclient),
light enough that 50 users do not load the 2-core host the API shares. The
host, the token and the task ids come from the environment of `bench/api_p99.py`.
"""

import os
import random
import time

import gevent
from locust import FastHttpUser, task

TOKEN = os.environ["POLYTRAIN_BENCH_TOKEN"]
TASK_IDS = [int(i) for i in os.environ["POLYTRAIN_BENCH_TASKS"].split(",")]
PERIOD_S = 1.0


class PortalClient(FastHttpUser):
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def on_start(self) -> None:
        """Wait a random fraction of the period: this user's phase."""
        gevent.sleep(random.uniform(0, PERIOD_S))
        self.due = time.perf_counter()

    def wait_time(self) -> float:
        """Constant pacing from this user's first request (one request per period)."""
        self.due += PERIOD_S
        return max(0.0, self.due - time.perf_counter())

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
