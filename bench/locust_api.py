"""Locust users of `bench/api_p99.py`: portal-like clients listing tasks and reading statuses.

Each user makes one request a second (constant pacing), like a portal page
polling: the task list (newest 50) and one task's status, 1 : 2. The client
is locust's FastHttpUser (geventhttpclient), light enough that 50 users do
not load the 2-core host the API shares. The host,
the token and the task ids come from the environment of `bench/api_p99.py`.
"""

import os
import random

from locust import FastHttpUser, constant_pacing, task

TOKEN = os.environ["POLYTRAIN_BENCH_TOKEN"]
TASK_IDS = [int(i) for i in os.environ["POLYTRAIN_BENCH_TASKS"].split(",")]


class PortalClient(FastHttpUser):
    wait_time = constant_pacing(1.0)

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
