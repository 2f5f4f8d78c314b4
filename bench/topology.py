"""Topology-aware against topology-blind placement on two real hosts (issue 26's figure).

    sudo python bench/topology.py                        # 1 Gbit/s between the hosts, MLP width 1024
    sudo python bench/topology.py --rate 500mbit --width 512

Two network namespaces on this machine, each a host with its own hostname and a torchrun agent of
two ranks, joined by a veth pair that `tc tbf` limits to `--rate` (tests/harness/two_hosts.py);
gloo over it. Every rank compiles the same MLP twice with P = 2 x D = 2 asked for: aware, over
the topology compile measures (ranks grouped by host, the link between hosts and inside each
measured), and blind, over the same devices as one flat level at the slowest measured link (the
planner then sees no hosts). Their steps are timed in turn, one aware step then one blind step, so
that both see the same load. Printed per plan: where each stage's copies run, the predicted step
(for the blind plan also re-simulated on the measured links), the measured median step, and the
ratio. Root only (network namespaces).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after the repository root is on sys.path
import torch.distributed as dist  # noqa: E402

import stagewise as sw  # noqa: E402
from stagewise.compiler.compile import costing  # noqa: E402
from tests.harness.host_worker import batches, compile_for_job, leave, placement  # noqa: E402
from tests.harness.two_hosts import run_job, two_hosts, unavailable  # noqa: E402


def flat(measure):
    """`cluster_topology` as a topology-blind planner sees it: every link the slowest one measured,
    one level, one host."""
    def blind(devices, local_rank):
        measured = measure(devices, local_rank)
        return sw.Topology.uniform(measured.n_devices, measured.slowest_link)
    return blind


def worker(args: argparse.Namespace) -> None:
    """One rank: compile aware and blind, time their steps in turn, rank 0 saves the figures."""
    torch.set_num_threads(1)
    aware = compile_for_job(2, 2, args.width, args.cost)
    with mock.patch.object(costing, "cluster_topology", flat(costing.cluster_topology)):
        blind = compile_for_job(2, 2, args.width, args.cost)
    x, y = batches(1)[0]
    seconds: dict[str, list[float]] = {"aware": [], "blind": []}
    for step in range(args.warmup + args.steps):
        for name, pipe in (("aware", aware), ("blind", blind)):
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x, target=y)
            dist.barrier()
            if step >= args.warmup:
                seconds[name].append(time.perf_counter() - start)
    where = {"aware": placement(aware), "blind": placement(blind)}
    if dist.get_rank() == 0:
        measured = aware.plan.costs.topology
        on_real_links = replace(blind.plan, costs=replace(blind.plan.costs, topology=measured))
        figures = {name: {"placement": where[name], "predicted_s": pipe.plan.predicted_iteration_s,
                          "seconds": seconds[name]} for name, pipe in (("aware", aware), ("blind", blind))}
        figures["blind"]["predicted_real_s"] = sw.simulate(on_real_links).iteration_time
        figures["links"] = {"inside": measured.link(0, 1), "between": measured.link(0, 2)}
        Path(args.out, "figures.pkl").write_bytes(pickle.dumps(figures))
    leave()


def report(figures: dict, args: argparse.Namespace) -> None:
    links = figures["links"]
    print(f"links measured: {links['inside'] / 1e9:.2f} GB/s inside a host, {links['between'] * 8 / 1e9:.3f} Gbit/s "
          f"between the hosts (tc tbf {args.rate})")
    print(f"{'plan':<7} {'stage copies on':<38} {'predicted':>10} {'on real links':>14} {'measured':>9} "
          f"{'pred/meas':>9}")
    for name in ("aware", "blind"):
        row = figures[name]
        hosts: dict[int, list[str]] = {}
        for stage, _, host in row["placement"]:
            hosts.setdefault(stage, []).append(host)
        copies = "; ".join(f"s{stage}: {','.join(on)}" for stage, on in sorted(hosts.items()))
        measured = statistics.median(row["seconds"])
        real = row.get("predicted_real_s", row["predicted_s"])
        print(f"{name:<7} {copies:<38} {row['predicted_s'] * 1e3:8.1f}ms {real * 1e3:12.1f}ms "
              f"{measured * 1e3:7.1f}ms {real / measured:9.2f}")
    speedup = statistics.median(figures["blind"]["seconds"]) / statistics.median(figures["aware"]["seconds"])
    predicted = figures["blind"]["predicted_real_s"] / figures["aware"]["predicted_s"]
    print(f"aware is {speedup:.2f}x faster than blind, measured (median of {args.steps} steps each, after "
          f"{args.warmup}); {predicted:.2f}x predicted on the measured links")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="the link between the hosts, as tc writes it")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's width (4 B x width^2 a layer)")
    parser.add_argument("--cost", choices=("profile", "analytic"), default="profile",
                        help="the layers' costs: measured on each rank, or from FLOPs")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help="(internal) run as one rank of the job")
    parser.add_argument("--out", help="(internal) where rank 0 writes its figures")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    reason = unavailable()
    if reason is not None:
        sys.exit(f"bench/topology.py: {reason}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"load: {open('/proc/loadavg').read().split()[:3]} (1 / 5 / 15 min), on a shared 2-core machine")
    out = Path(tempfile.mkdtemp(prefix="stagewise-topology-"))
    program = [str(Path(__file__).resolve()), "--worker", "--width", str(args.width), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--cost", args.cost, "--out", str(out)]
    with two_hosts(args.rate) as hosts:
        agents = run_job(hosts, 2, [program, program], out, limit_s=300.0)
    if any(code != 0 for code, _ in agents):
        sys.exit("the job failed:\n" + "\n".join(text[-3000:] for _, text in agents))
    report(pickle.loads((out / "figures.pkl").read_bytes()), args)


if __name__ == "__main__":
    main()
