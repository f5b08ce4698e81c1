"""Entry point of one rank: ``python -m worker.engine.launch --spec /path/spec.json``.

Reads its place from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
and ``LOCAL_RANK``; rank 0 runs the parameter server, the others train.
Exit code 0 on success; on any error the full traceback goes to stderr and the
process exits 1 at once (without waiting for peers, which notice the broken
connection or time out).

Other environment variables: ``POLYTRAIN_DIST_TIMEOUT_S`` (seconds, default
120) bounds rendezvous and every collective; ``POLYTRAIN_NUM_THREADS``
(default 1) sets torch's intra-op threads. With ``RunSpec.debug_dump_dir`` set,
each rank saves its final parameters and buffers there (debugging).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import traceback
from pathlib import Path

import torch

from worker.engine import distributed, report, shard_server
from worker.engine.contract import load_training_code, seed_everything
from worker.engine.data import prepare_data
from worker.engine.distributed import ClusterEnv
from worker.engine.ps import run_parameter_server
from worker.engine.spec import RunSpec
from worker.engine.trainer import run_worker
from worker.engine.trial import run_trial


def run(spec: RunSpec, env: ClusterEnv, timeout_s: float) -> torch.Tensor:
    """Take part in the task as rank ``env.rank``; returns its final parameters and buffers
    [P + B] where ``spec.debug_dump_dir`` is set (an empty tensor otherwise, and in a trial).

    The global generators are reset to ``spec.seed`` before ``build_model``
    (so every rank builds the same model) and before ``build_datasets`` (run
    on every compute worker, :func:`worker.engine.data.prepare_data`), then to
    ``spec.seed * 1000 + rank`` for training (dropout differs by worker).
    """
    clock = report.StartupClock()
    clock.mark("import")  # the interpreter, torch and the engine
    topo = distributed.init(env, spec, timeout_s)
    clock.mark("rendezvous")  # includes waiting for the last rank to arrive
    if topo.is_shard_server:  # no model, no data: a slice of the parameter server's
        assert topo.shards is not None
        report.log(
            f"rank {env.rank}/{env.world_size} up: shard {topo.shards.shard} of "
            f"{len(topo.shards.servers)} of the parameter server"
        )
        shard_server.serve(topo, spec)
        distributed.destroy()
        return torch.empty(0)
    # Loaded after joining, so a rank that fails here breaks its peers' connections at once.
    code = load_training_code(spec.code, spec.hyperparameters)
    report.log(
        f"rank {env.rank}/{env.world_size} up: group {topo.group_index}, "
        f"device {topo.device}, leader {topo.am_i_leader}"
    )
    seed_everything(spec.seed)
    model = code.build_model()
    clock.mark("model")
    data = prepare_data(code, topo, spec.preprocess, spec.data, spec.seed)
    clock.mark("data")
    seed_everything(spec.seed * 1000 + env.rank)
    if spec.trial is not None:
        run_trial(spec, code, topo, model, data, clock)
        final = torch.empty(0)  # a trial trains nothing
    elif topo.is_ps:
        final = run_parameter_server(spec, code, topo, model, data, clock)
    else:
        final = run_worker(spec, code, topo, model, data, clock)
    distributed.destroy()
    return final


def dump_params(spec: RunSpec, final: torch.Tensor, rank: int) -> None:
    """Save ``final`` to ``rank-{rank}.pt`` in ``spec.debug_dump_dir``, when that is set."""
    if spec.debug_dump_dir:
        Path(spec.debug_dump_dir).mkdir(parents=True, exist_ok=True)
        torch.save(final, Path(spec.debug_dump_dir) / f"rank-{rank}.pt")


def main(argv: list[str] | None = None) -> int:
    """Parse ``--spec``, run this rank, return the exit code (0); exits 1 on any error."""
    parser = argparse.ArgumentParser(description="Run one rank of a polytrain task.")
    parser.add_argument("--spec", required=True, help="path of the RunSpec JSON file")
    args = parser.parse_args(argv)
    try:
        torch.set_num_threads(int(os.environ.get("POLYTRAIN_NUM_THREADS", "1")))
        spec = RunSpec.model_validate_json(Path(args.spec).read_text())
        env = ClusterEnv.from_env()
        timeout_s = float(os.environ.get("POLYTRAIN_DIST_TIMEOUT_S", "120"))
        dump_params(spec, run(spec, env, timeout_s), env.rank)
    except BaseException:
        traceback.print_exc()
        # Skip interpreter teardown: joining gloo threads blocked on dead peers can hang.
        exit_now(1)
    return 0


def exit_now(code: int) -> None:
    """Flush the output and end the process without interpreter teardown.

    After a finished run too: at teardown, gloo's threads can still hold work objects
    whose tensors need the interpreter being torn down, and the process then aborts with
    ``terminate called without an active exception`` (exit 134) although training
    finished (pytorch/pytorch#179291, #190489; seen with plain DDP as well).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # C-level buffers too (e.g. NCCL_DEBUG lines of a library)
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
