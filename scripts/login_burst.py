"""What a burst of logins and a huge login body do to the API (a measurement, not a test).

Starts `polytrain api` on a fresh SQLite data dir, then measures:
1. /api/v1/health latency at rest (sequential calls);
2. /api/v1/health latency and the API's resident memory while `--logins` logins (the
   right password) arrive at once, and the answers they get;
3. the API's resident memory while a `--body-mb` MB login body is sent.

    .venv/bin/python scripts/login_burst.py [--repo PATH] [--env KEY=VALUE ...]

`--repo` runs another checkout's code with this venv (e.g. the code before a change).
Prints one JSON object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from worker.engine.ranks import free_port

EMAIL, PASSWORD = "admin@example.org", "burst-test-password"


def start_api(repo: Path, data_dir: Path, port: int, extra: dict[str, str]) -> subprocess.Popen:
    env = {
        **os.environ,
        "POLYTRAIN_DATA_DIR": str(data_dir),
        "POLYTRAIN_AGENT_TOKEN": "t" * 32,
        "POLYTRAIN_ADMIN_EMAIL": EMAIL,
        "POLYTRAIN_ADMIN_PASSWORD": PASSWORD,
        "PYTHONPATH": str(repo),
        **extra,
    }
    for name in ("DATABASE_URL", "BROKER_URL"):
        env.pop(name, None)
    # The command's module in that checkout (it was backend/cli.py before polytrain/ existed).
    cli = "polytrain.cli" if (repo / "polytrain" / "cli.py").is_file() else "backend.cli"
    subprocess.run(
        [sys.executable, "-m", cli, "db", "upgrade"],
        cwd=repo,
        env=env,
        check=True,
        capture_output=True,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", cli, "api", "--port", str(port)], cwd=repo, env=env
    )
    url = f"http://127.0.0.1:{port}/api/v1/health"
    for _ in range(300):
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the API did not start")


def latencies_ms(url: str, stop: threading.Event, out: list[float], pause_s: float) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get(url)
            out.append((time.perf_counter() - started) * 1000)
            time.sleep(pause_s)


def watch_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.02)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "median_ms": round(statistics.median(ordered), 1),
        "p95_ms": round(ordered[int(0.95 * (len(ordered) - 1))], 1),
        "max_ms": round(ordered[-1], 1),
    }


def burst(base: str, pid: int, logins: int) -> dict:
    stop, health, peak = threading.Event(), [], [psutil.Process(pid).memory_info().rss]
    watchers = [
        threading.Thread(target=latencies_ms, args=(f"{base}/api/v1/health", stop, health, 0.05)),
        threading.Thread(target=watch_rss, args=(pid, stop, peak)),
    ]
    statuses: Counter[int] = Counter()
    gate = threading.Barrier(logins)

    def login() -> None:
        gate.wait()
        answer = httpx.post(
            f"{base}/api/v1/auth/login", timeout=120, json={"email": EMAIL, "password": PASSWORD}
        )
        statuses[answer.status_code] += 1

    rss_before = peak[0]
    for w in watchers:
        w.start()
    started = time.perf_counter()
    threads = [threading.Thread(target=login) for _ in range(logins)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    stop.set()
    for w in watchers:
        w.join()
    return {
        "health_during": summary(health),
        "login_statuses": dict(statuses),
        "burst_s": round(elapsed, 2),
        "rss_before_mb": rss_before // 2**20,
        "rss_peak_mb": peak[0] // 2**20,
    }


def big_body(base: str, pid: int, megabytes: int) -> dict:
    stop, peak = threading.Event(), [psutil.Process(pid).memory_info().rss]
    before = peak[0]
    watcher = threading.Thread(target=watch_rss, args=(pid, stop, peak))
    watcher.start()

    def body():  # type: ignore[no-untyped-def]
        for _ in range(megabytes):
            yield b" " * 2**20

    try:
        answer = httpx.post(
            f"{base}/api/v1/auth/login",
            content=body(),
            timeout=120,
            headers={"Content-Type": "application/json", "Content-Length": str(megabytes * 2**20)},
        )
        status: int | str = answer.status_code
    except httpx.HTTPError as exc:  # the server may close the connection mid-upload
        status = type(exc).__name__
    time.sleep(0.5)
    stop.set()
    watcher.join()
    return {"status": status, "rss_before_mb": before // 2**20, "rss_peak_mb": peak[0] // 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--logins", type=int, default=60)
    parser.add_argument("--body-mb", type=int, default=200)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the API")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="polytrain-burst-") as tmp:
        proc = start_api(args.repo.resolve(), Path(tmp) / "var", port, extra)
        base = f"http://127.0.0.1:{port}"
        try:
            httpx.post(
                f"{base}/api/v1/auth/login", timeout=60, json={"email": EMAIL, "password": PASSWORD}
            )  # warm up
            stop, rest = threading.Event(), []
            timer = threading.Timer(3.0, stop.set)
            timer.start()
            latencies_ms(f"{base}/api/v1/health", stop, rest, 0.05)
            result = {
                "repo": str(args.repo),
                "env": extra,
                "health_at_rest": summary(rest),
                **burst(base, proc.pid, args.logins),
                "big_body": big_body(base, proc.pid, args.body_mb),
            }
        finally:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
