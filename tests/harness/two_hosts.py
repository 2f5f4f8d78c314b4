"""Two hosts on this machine: two network namespaces joined by a veth pair, each namespace a host
with its own hostname (what compiler/compile/cluster.py groups ranks by) and one torchrun agent,
the link between them limited by `tc tbf` (this kernel has no netem), gloo over the veth.

Ranks of one host talk to each other over that namespace's loopback (the kernel routes a
namespace's own address locally); ranks of two hosts cross the limited veth. The addresses exist
only inside the namespaces. Whatever `two_hosts` creates is deleted when it ends, however it ends:
the agents and their workers killed first, then the namespaces (which takes their veth ends and
the link with them). Root only (`unavailable`: why not here).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT = 29500  # the rendezvous port on the first host: its namespace has no other listener
SUBNET = "10.77.0"  # inside the namespaces only; each namespace has its own routing table


@dataclass(frozen=True)
class Host:
    """One namespace: its name, the hostname its processes see, its veth and its address on it."""

    namespace: str
    hostname: str
    interface: str
    address: str


def unavailable() -> str | None:
    """Why two hosts cannot be made here (a reason for pytest.skip), or None."""
    if os.geteuid() != 0:
        return "two network namespaces need root"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"two network namespaces need {', '.join(missing)}"
    return None


def namespaces() -> set[str]:
    """The network namespaces that exist now (for checking that `two_hosts` left none behind)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@contextlib.contextmanager
def two_hosts(rate: str = "1gbit", pair: str = "") -> Iterator[tuple[Host, Host]]:
    """Two hosts joined by a veth link of `rate` each way; deleted at the end, even on failure.
    `pair`: a letter that tells this pair from another made by the same process at the same time."""
    tag = f"sw{os.getpid() % 100000}{pair}"
    hosts = tuple(Host(f"{tag}-{side}", f"host-{side}", f"{tag}{side}", f"{SUBNET}.{i + 1}")
                  for i, side in enumerate("ab"))
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            # a token bucket per direction (each end limits what it sends): the link's rate both ways
            _run("ip", "netns", "exec", host.namespace, "tc", "qdisc", "add", "dev", host.interface, "root", "tbf",
                 "rate", rate, "burst", "256kb", "latency", "100ms")
        yield hosts[0], hosts[1]
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, check=False)


def on_host(host: Host, command: Sequence[str]) -> list[str]:
    """`command` run inside `host`: its network namespace, a UTS namespace of its own named
    `host.hostname`."""
    return ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c",
            f'hostname {host.hostname} && exec "$@"', "sh", *command]


def torchrun(host: Host, first: Host, node_rank: int, per_host: int, program: Sequence[str]) -> list[str]:
    """One agent of a 2-host job on `host` running `program` (['-m', module, ...] or [script, ...]):
    static rendezvous on the first host's address, so that ranks are numbered host by host
    (torchrun's numbering, which cluster.py reads as levels)."""
    return on_host(host, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
                          f"--nproc-per-node={per_host}", "--rdzv-backend=static", f"--master-addr={first.address}",
                          f"--master-port={PORT}", "--monitor-interval=0.1", *program])


def elastic_torchrun(host: Host, first: Host, program: Sequence[str]) -> list[str]:
    """One agent of an elastic job of one or two hosts (one rank each) on `host`: c10d rendezvous
    kept by the first host, whose address sorts first (its rank is 0). A host that misses two 1 s
    heartbeats is gone; the survivor waits 5 s for others, then restarts its worker alone."""
    conf = "join_timeout=30,last_call_timeout=5,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
    return on_host(host, [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                          "--rdzv-backend=c10d", f"--rdzv-endpoint={first.address}:{PORT}", "--rdzv-id=two-hosts",
                          f"--local-addr={host.address}", f"--rdzv-conf=is_host={int(host == first)},{conf}",
                          "--max-restarts=1", "--monitor-interval=0.1", *program])


def environment(host: Host) -> dict[str, str]:
    """What every rank of `host` runs with: gloo on the veth's address, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "TORCHELASTIC", "GROUP_"))}
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: a restart would read the last attempt's addresses (pytorch/pytorch#135712)
    return {**env, "GLOO_SOCKET_IFNAME": host.interface, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run_job(hosts: tuple[Host, Host], per_host: int | None, programs: Sequence[Sequence[str]], out: Path,
            limit_s: float) -> list[tuple[int | None, str]]:
    """Both agents of one job, each running its host's program (as `torchrun` takes it), which
    names the folder `out` (where the agents' logs go, and what finds the workers to kill);
    `per_host` ranks on each host (None: an elastic job, `elastic_torchrun`). Each agent's exit
    status (None: killed at `limit_s`) and output. Every process started here is killed at the
    end, whatever happened."""
    out.mkdir(parents=True, exist_ok=True)
    started: list[subprocess.Popen] = []
    try:
        for node_rank, (host, program) in enumerate(zip(hosts, programs, strict=True)):
            command = elastic_torchrun(host, hosts[0], program) if per_host is None \
                else torchrun(host, hosts[0], node_rank, per_host, program)
            with open(out / f"{host.hostname}.log", "w") as log:
                started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment(host),
                                                cwd=ROOT, start_new_session=True))
        deadline = time.monotonic() + limit_s
        codes = [_wait(process, deadline) for process in started]
    finally:
        for process in started:  # each agent leads a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        for pid in pids_naming(str(out)):  # the workers, each in a session torchrun gave it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return [(code, (out / f"{host.hostname}.log").read_text()) for code, host in zip(codes, hosts, strict=True)]


def pids_naming(tag: str) -> list[int]:
    """The processes whose command line names `tag` (this job's folder), this one excepted."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if tag in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
    return pids


def _wait(process: subprocess.Popen, deadline: float) -> int | None:
    try:
        return process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*command: str) -> None:
    subprocess.run(command, capture_output=True, text=True, check=True)
