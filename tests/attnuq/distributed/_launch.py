"""Start ``world`` worker processes of a gloo group on this machine (a torchrun-like env)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import attnuq

SRC = Path(attnuq.__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_for(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           **extra}
    return env


class Launch:
    """Processes started together (the ranks of one group, or a torchrun agent)."""

    def __init__(self, name: str, cmds: list[list[str]], envs: list[dict[str, str]],
                 timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.t_end = time.monotonic() + timeout_s
        self.procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True) for c, e in zip(cmds, envs, strict=True)]
        self._done: list[subprocess.CompletedProcess[str]] | None = None

    def wait(self) -> list[subprocess.CompletedProcess[str]]:
        """Every process finished (killed, and the test failed, past the timeout)."""
        if self._done is None:
            done = []
            for p in self.procs:
                try:
                    so, se = p.communicate(timeout=max(1.0, self.t_end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    for q in self.procs:
                        q.kill()
                    raise AssertionError(f"{self.name} hung past {self.timeout_s} s") from None
                done.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
            self._done = done
        return self._done


def start_forked(specs: list[tuple[str, int, Path]], out: Path, *, timeout_s: float = 240.0,
                 **extra: str) -> Launch:
    """One fresh process imports torch, scipy and attnuq once, then forks every rank of each
    ``(scenario, world, folder)`` spec (each spec its own group and port): one import instead
    of one per rank, which on a loaded 2-core machine is most of the cost. Each rank's exit
    status goes to ``out/exit_codes.json``, its output to ``<folder>/rank<R>.log``."""
    plan = [{"scenario": sc, "world": w, "out": str(d), "port": free_port()}
            for sc, w, d in specs]
    cmd = [sys.executable, str(WORKER), "--fork", str(out), json.dumps(plan)]
    env = env_for(0, 1, 0, **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k)
    return Launch(f"forked ranks of {[(sc, w) for sc, w, _ in specs]}", [cmd], [env], timeout_s)


def start_torchrun(nproc: int, cli_args: list[str], *, timeout_s: float = 240.0,
                   script: list[str] | None = None) -> Launch:
    """``torchrun --nproc-per-node nproc -m attnuq.cli cli_args...`` from this interpreter
    (``script``: ``torchrun ... script... cli_args...`` instead, e.g. a wrapper of the CLI)."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           *(script if script is not None else ["-m", "attnuq.cli"]), *cli_args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", ATTNUQ_DIST_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return Launch(f"torchrun x{nproc} attnuq {' '.join(cli_args[:1])}", [cmd], [env], timeout_s)
