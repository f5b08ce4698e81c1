"""The portal's sweep pages: the form keeps what was typed after a refusal, a started sweep
opens its page with every trial, the best highlighted and the chart's data."""

import json
import re
from html import unescape

from fastapi.testclient import TestClient

from tests.backend.sweeps.test_sweeps_api import report, set_running
from tests.conftest import make_group, make_project, with_csrf

FORM = {
    "name": "widths",
    "groups": "cpu-a:1",
    "epochs": "2",
    "global_batch_size": "16",
    "algorithm": "grid",
    "space": '{"hidden": [16, 32, 64]}',
    "parallel": "3",
    "metric": "val_loss",
    "goal": "min",
    "seed": "0",
    "early_stopping": "median",
}


def test_start_a_sweep_from_the_form_and_read_its_page(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    project, version = make_project(client)
    page = client.get(f"/projects/{project['id']}")
    assert f'href="/projects/{project["id"]}/sweeps"' in page.text
    url = f"/projects/{project['id']}/sweeps"
    assert 'id="sweep-form"' in client.get(url).text

    form = {**FORM, "code_version_id": str(version["id"])}
    refused = client.post(url, data=with_csrf(client, {**form, "space": '{"depth": [1]}'}))
    assert refused.status_code == 422
    assert "is not declared in the code&#39;s HYPERPARAMETERS" in refused.text
    assert 'id="error-space"' in refused.text
    assert "{&#34;depth&#34;: [1]}" in refused.text  # the space as typed
    assert 'value="widths"' in refused.text and 'value="cpu-a:1"' in refused.text
    bad_groups = client.post(url, data=with_csrf(client, {**form, "groups": "cpu-a:x"}))
    assert bad_groups.status_code == 422 and 'id="error-groups"' in bad_groups.text
    # the first trials' refusal names the task's field: shown beside the groups, not atop
    gone = client.post(url, data=with_csrf(client, {**form, "groups": "gone:1"}))
    assert gone.status_code == 422 and 'id="error-groups"' in gone.text, gone.text
    assert "resource group &#39;gone&#39; does not exist" in gone.text
    assert 'id="error-__all__"' not in gone.text

    started = client.post(url, data=with_csrf(client, form), follow_redirects=False)
    assert started.status_code == 303, started.text
    sweep_url = started.headers["location"]
    sweep_id = int(sweep_url.rsplit("/", 1)[1])
    detail = client.get(f"/api/v1/sweeps/{sweep_id}").json()
    ids = [t["task_id"] for t in detail["trials"]]
    assert len(ids) == 3
    set_running(*ids)
    report(client, ids[0], [0.9])
    report(client, ids[1], [0.5])
    shown = client.get(sweep_url)
    assert shown.status_code == 200
    best = re.search(r'<tr data-trial="(\d)" class="best"', shown.text)
    assert best and best.group(1) == "2"
    chart = json.loads(unescape(re.search(r'data-chart="([^"]*)"', shown.text).group(1)))
    assert chart["names"] == ["hidden"] and chart["best"] == 2
    assert [(p["values"]["hidden"], p["objective"]) for p in chart["points"]] == [
        (16, 0.9),
        (32, 0.5),
    ]
    assert f'href="/sweeps/{sweep_id}"' in client.get(url).text  # listed on the project's
    cancelled = client.post(
        f"/sweeps/{sweep_id}/cancel", data=with_csrf(client, {}), follow_redirects=False
    )
    assert cancelled.status_code == 303
    assert client.get(f"/api/v1/sweeps/{sweep_id}").json()["status"] == "CANCELLED"
