"""Benchmark ``engine_vs_ddp_step_ratio``: the engine's step time over plain PyTorch DDP's.

What a user would otherwise run is ``torch.nn.parallel.DistributedDataParallel`` (gloo,
default buckets) on the same processes. Both train bench/workloads/sized_mlp.py (an MLP
256 -> H -> H -> 10) with the same data, seed, global batch (128: 64 per worker) and SGD,
one torch thread per process, no throttling, even split, each compute process pinned to
its own core of this 2-core host (the parameter server, idle during steps, is not pinned):

- **DDP**: 2 ranks; each takes its half of every global batch of a seeded permutation.
- **engine 1 x 2**: one group of 2 workers, sync strategy, plus the parameter server.
- **engine 2 x 1**: two groups of 1 worker each (the cross-group path).
- with ``--ps-shards S`` (S > 1), **engine 2 x 1 with shards**: the same, the groups' sum
  by the parameter server's S shards (worker.engine.shard_server.OwnerSum) instead of the
  leaders' ring; the line adds its ratio to DDP and to the ring arm (``shards_over_ring``).

Step time of a run: its second epoch's seconds over its steps (128 an epoch at 37k
parameters, 32 at 1M, 8 above: an epoch of at least about 0.2 s; the first epoch warms up);
for the engine the parameter server's ``epoch_time_s`` (validation, the epoch-end model
transfer and checkpoint excluded), for DDP the same measured around its step loop. Every
round runs the three arms back to back, in reversed order every other round
(bench/stats.py); the ratio of a round is its engine step time over its DDP step time, and
the line reports the median of ``--rounds`` rounds with a 95 % bootstrap interval. Sizes:
about 37k, 1M, 10M and 25M parameters. One JSON line per size
(``engine_vs_ddp_step_ratio_<size>``), then the summary ``engine_vs_ddp_step_ratio`` whose
value is the worst 1 x 2 median (target <= 1.10 at every size; 2 x 1 target <= 1.25). Ideal
1.0: the engine costs what DDP costs.

    python -m bench.engine_vs_ddp [--rounds 5] [--sizes 100,880,3030,4870]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch

from bench.common import emit, workload
from bench.stats import paired_ratios, paired_rounds, summary
from bench.throttle import pin
from worker.engine.launch import exit_now
from worker.engine.local import launch_local
from worker.engine.ranks import free_port
from worker.engine.spec import RunSpec

GLOBAL_BATCH, EPOCHS = 128, 2


def steps_for(hidden: int) -> int:
    """Steps an epoch: enough that an epoch lasts about 0.2 s or more on this host (a 34k
    model's 2 ms step over 8 steps would measure the epoch's boundaries, not its steps)."""
    return 128 if hidden <= 200 else 32 if hidden <= 1000 else 8


CORES = (0, 1)  # compute process i runs on core CORES[i]
DDP_TIMEOUT_S = 900  # a plain DDP run (the largest size's epochs take under a minute)
RENDEZVOUS_TIMEOUT_S = 300  # a DDP rank's wait for its peer, at the rendezvous or a collective


def _env(hidden: int) -> dict[str, str]:
    return {
        "POLYTRAIN_BENCH_HIDDEN": str(hidden),
        "POLYTRAIN_BENCH_ITEMS": str(GLOBAL_BATCH * steps_for(hidden)),
        "POLYTRAIN_NUM_THREADS": "1",
    }


def ddp_rank(rank: int, port: int) -> NoReturn:
    """One DDP rank (run as ``--ddp-rank``): trains EPOCHS epochs, rank 0 prints step times."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    pin(os.getpid(), CORES[rank])
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # A rank whose peer died fails at the rendezvous or its next collective within the
    # timeout instead of waiting torch's default half hour.
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    )
    sys.path.insert(0, str(Path(workload("sized_mlp")).parent))
    import sized_mlp  # type: ignore[import-not-found]

    torch.manual_seed(0)
    model = DistributedDataParallel(sized_mlp.build_model())
    train, _ = sized_mlp.build_datasets()
    x, y = train.tensors
    steps = len(x) // GLOBAL_BATCH
    optimizer = sized_mlp.build_optimizer(model.parameters())
    per_step = []
    for epoch in range(EPOCHS):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        dist.barrier()
        started = time.perf_counter()
        for step in range(steps):
            batch = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
            mine = batch[rank * GLOBAL_BATCH // 2 : (rank + 1) * GLOBAL_BATCH // 2]
            optimizer.zero_grad(set_to_none=True)
            sized_mlp.loss_fn(model(x[mine]), y[mine]).backward()
            optimizer.step()
        dist.barrier()
        per_step.append((time.perf_counter() - started) / steps)
    if rank == 0:
        print(json.dumps({"step_s": per_step[1:]}), flush=True)
    # End here, with the model alive: freeing DDP's reducer (on return) destroys its gloo
    # group, whose destructor joins gloo's threads while one of them waits for the GIL this
    # thread holds (seen: both ranks stuck there for good after a finished run).
    exit_now(0)


def ddp_step_s(hidden: int, tries: int = 2) -> list[float]:
    """Seconds per step of plain DDP on 2 gloo ranks (epochs after the first).

    A run whose ranks fail (e.g. another process took the rendezvous port between
    :func:`free_port` and rank 0's bind) is run again on a new port, up to ``tries`` runs in
    all; then the benchmark exits naming what failed. No rank outlives its run."""
    failed: list[str] = []
    for attempt in range(1, tries + 1):
        out, failed = _ddp_run(hidden)
        if not failed:
            return list(json.loads(out[0][0].strip().splitlines()[-1])["step_s"])
        print(f"DDP run {attempt} of {tries} failed:\n" + "\n".join(failed), file=sys.stderr)
    sys.exit("DDP run failed:\n" + "\n".join(failed))


def _ddp_run(hidden: int) -> tuple[list[tuple[str, str]], list[str]]:
    """One plain DDP run: each rank's ``(stdout, stderr)`` and what failed (empty when none).
    A rank that fails ends the run at once (its peer would wait for it at a collective), as
    does :data:`DDP_TIMEOUT_S`."""
    port = free_port()
    env = {**os.environ, **_env(hidden)}
    command = [sys.executable, "-m", "bench.engine_vs_ddp", "--port", str(port), "--ddp-rank"]
    killed: list[int] = []
    with tempfile.TemporaryDirectory(prefix="polytrain-ddp-") as tmp:
        files = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(2)]
        procs = []
        for r, (out, err) in enumerate(files):
            with out.open("w") as stdout, err.open("w") as stderr:
                procs.append(
                    subprocess.Popen([*command, str(r)], env=env, stdout=stdout, stderr=stderr)
                )
        deadline = time.monotonic() + DDP_TIMEOUT_S
        try:
            while True:
                codes = [p.poll() for p in procs]  # every rank's: one that failed ends the run
                if None not in codes or any(codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    killed.append(r)
        texts = [(out.read_text(), err.read_text()) for out, err in files]
    failed = [
        f"rank {r} {ended(p.returncode)}: {texts[r][1][-1500:]}"
        for r, p in enumerate(procs)
        if p.returncode and r not in killed
    ]
    if killed:
        failed.append(f"ranks {killed} stopped: the run failed or ran over {DDP_TIMEOUT_S} s")
    return texts, failed


def ended(code: int) -> str:
    """How a process with exit status ``code`` (``Popen.returncode``) ended, in words."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited {code}"


def engine_step_s(hidden: int, groups: list[dict[str, Any]], ps_shards: int = 1) -> list[float]:
    """Seconds per step of the engine (the parameter server's epoch time over its steps);
    ``ps_shards`` > 1: the groups' sum by the parameter server's shards (unpinned, as the
    parameter server), not the leaders' ring."""
    with tempfile.TemporaryDirectory(prefix="polytrain-bench-") as tmp:
        spec = RunSpec.model_validate(
            {
                "task_id": 0,
                "code": workload("sized_mlp"),
                "epochs": EPOCHS,
                "global_batch_size": GLOBAL_BATCH,
                "groups": groups,
                "checkpoint_dir": str(Path(tmp) / "ck"),
                "ps_shards": ps_shards,
            }
        )
        run = launch_local(
            spec,
            timeout_s=900,
            env_extra=_env(hidden),
            on_spawn=lambda pids: [pin(pids[r], CORES[r - 1]) for r in (1, 2)],
        )
    if not run.ok:
        for rank in run.output:
            print(f"--- rank {rank}\n" + "\n".join(run.output[rank][-20:]), file=sys.stderr)
        sys.exit(1)
    steps = steps_for(hidden)
    return [t / steps for t in run.metrics("epoch_time_s", rank=0)[1:] if t is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="100,880,3030,4870", help="hidden widths H")
    parser.add_argument(
        "--ps-shards",
        type=int,
        default=1,
        help="S > 1 adds the arm 2x1_shards: engine 2 x 1 with the groups' sum by S shards",
    )
    parser.add_argument("--ddp-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_rank is not None:
        ddp_rank(args.ddp_rank, args.port)  # ends the process (exit_now)
    one_group = [{"name": "a", "device_type": "cpu", "workers": 2}]
    two_groups = [
        {"name": "a", "device_type": "cpu", "workers": 1},
        {"name": "b", "device_type": "cpu", "workers": 1},
    ]
    worst = {"1x2": 0.0, "2x1": 0.0}
    for hidden in (int(h) for h in args.sizes.split(",")):
        params = 256 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10
        arms = {
            "ddp": lambda h=hidden: statistics.median(ddp_step_s(h)),
            "1x2": lambda h=hidden: statistics.median(engine_step_s(h, one_group)),
            "2x1": lambda h=hidden: statistics.median(engine_step_s(h, two_groups)),
        }
        if args.ps_shards > 1:
            arms["2x1_shards"] = lambda h=hidden: statistics.median(
                engine_step_s(h, two_groups, args.ps_shards)
            )
        times = paired_rounds(arms, args.rounds)
        ratios = {k: summary(paired_ratios(times[k], times["ddp"])) for k in arms if k != "ddp"}
        extra = {}
        if args.ps_shards > 1:
            by_ring = summary(paired_ratios(times["2x1_shards"], times["2x1"]))
            extra = {
                "ps_shards": args.ps_shards,
                "ratio_2x1_shards": ratios["2x1_shards"]["median"],
                "shards_over_ring": by_ring["median"],
                "ci95_shards_over_ring": by_ring["ci95"],
            }
        worst = {k: max(worst[k], ratios[k]["median"]) for k in worst}
        emit(
            f"engine_vs_ddp_step_ratio_{params / 1e6:.2g}M",
            ratios["1x2"]["median"],
            "<= 1.10",
            ideal=1.0,
            parameters=params,
            ci95=ratios["1x2"]["ci95"],
            ratio_2x1=ratios["2x1"]["median"],
            ci95_2x1=ratios["2x1"]["ci95"],
            target_2x1="<= 1.25",
            **extra,
            rounds=args.rounds,
            ratios={k: v["values"] for k, v in ratios.items()},
            median_step_ms={k: round(statistics.median(v) * 1000, 2) for k, v in times.items()},
            step_ms={k: [round(t * 1000, 2) for t in v] for k, v in times.items()},
        )
    emit(
        "engine_vs_ddp_step_ratio",
        worst["1x2"],
        "<= 1.10",
        ideal=1.0,
        worst_2x1=round(worst["2x1"], 4),
        target_2x1="<= 1.25",
        global_batch=GLOBAL_BATCH,
    )


if __name__ == "__main__":
    main()
