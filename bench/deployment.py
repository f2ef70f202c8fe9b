"""Benchmark: a deployed round against a simulated one, and what one ClientApp message costs.

One FedPAC run config (Fashion-MNIST, paper protocol: 20 clients, 600 samples, E = 5, full
participation) runs three times on this machine, one after the other:

1. as Flower's Ray simulation (``experiments.simulation``, one CPU per client);
2. as a localhost deployment: a SuperLink and N SuperNodes started with ``deploy/superlink.sh``
   and ``deploy/supernode.sh`` (TLS, SuperNode authentication), each on its own data folder
   (the simulation's partitions, exported by ``deploy/export_partitions.py``, as a real site
   holds its data), each ClientApp in a warm worker (``deploy/warm_executor.py``), driven by
   ``flwr run`` like a user's workstation;
3. (``--cold-rounds`` > 0) the same deployment with Flower's own executor, a fresh ClientApp
   process per message (``supernode.sh --executor cold``): the "before";
4. (``--variant LABEL:KEY=VALUE,...``, repeatable) the deployment of 2. again with these
   environment variables set for the SuperLink and the SuperNodes, e.g. an A/B of one launcher
   feature in the same run: ``--variant "object waits off:FEDPAC_SUPERLINK_OBJECT_WAIT=0,FEDPAC_NODE_OBJECT_WAIT=0"``.

Every process gets one torch thread (``OMP_NUM_THREADS=1``), as Ray gives each simulated
client one CPU, so the runs compute the same thing and must report the same accuracies; the
warm workers run at niceness 10 (``FEDPAC_WORKER_NICE``) so that N nodes' training on one host
does not starve the SuperNodes and the SuperLink; and the nodes' workers share the host's
cores as the simulation's clients do, at most one training per core at a time
(``--host-slots``, default the number of cores; 0 lets all N train at once, as N hosts would).
Reported: median round wall time over rounds 2..R of each, the ratio deployment / simulation,
and the largest per-round accuracy difference; with ``--cpu-profile`` also each deployment's CPU
seconds per round by kind of process (SuperLink, ServerApp, SuperNodes, executors, ClientApp
workers, other) and the host's idle time, over rounds 2..R-1 (``bench/cpu_profile.py``).
Then a per-message breakdown, measured in a fresh process like the one Flower's own executor
starts for every message: interpreter and imports, data loading, device set-up, compute, reply;
and the same for a second message in the same process (what a warm worker pays).

    python bench/deployment.py --clients 20 --rounds 5 --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import memory  # noqa: E402
from bench.cpu_profile import ProcessCpu  # noqa: E402
from tests.deployment import Federation, create_certificates, rounds_of  # noqa: E402


def paper_config(args: argparse.Namespace) -> dict:
    return {"dataset": args.dataset, "num-server-rounds": args.rounds, "seed": args.seed,
            "min-available-clients": args.clients, "round-timeout": args.round_timeout}


def simulate(args: argparse.Namespace, out: Path) -> list[dict]:
    config = {**paper_config(args), "output-dir": str(out)}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_TELEMETRY_ENABLED": "0"}
    subprocess.run([sys.executable, "-m", "experiments.simulation", "--run-config", json.dumps(config),
                    "--clients", str(args.clients), "--cpus-per-client", "1"],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return rounds_of(out)


def export_partitions(args: argparse.Namespace, out: Path) -> Path:
    """The simulation's partitions as one data folder per site (what a real site holds)."""
    subprocess.run([sys.executable, str(ROOT / "deploy" / "export_partitions.py"), "--clients", str(args.clients),
                    "--out", str(out), "--run-config", f"dataset='{args.dataset}' seed={args.seed}"],
                   check=True, capture_output=True)
    return out


def wait_for_rounds(out: Path, rounds: int, timeout: float) -> None:
    """Until the run folder has ``rounds`` rounds: read from the disk, not by `flwr ls`, whose
    process start every few seconds would cost CPU the measured rounds need."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(rounds_of(out)) < rounds:
        time.sleep(1.0)


def deploy(args: argparse.Namespace, work: Path, executor: str, rounds: int,
           data: Path) -> tuple[list[dict], dict[str, float], dict]:
    """The deployment's rounds, with ``--cpu-profile`` the host's CPU seconds per round by
    process kind (rounds 2..R-1; ``bench/cpu_profile.py``), and with ``--site-memory`` what the
    sites and the SuperLink take in memory (:func:`site_memory`)."""
    work.mkdir(parents=True)
    host_before = memory.host_used_mb()
    os.environ["FEDPAC_HOST_SLOTS"], os.environ["FEDPAC_HOST_SLOTS_DIR"] = str(args.host_slots), str(work / "slots")
    certs = create_certificates(work / "certs", args.clients)
    federation = Federation(work, certs, args.clients, database=args.superlink_database)
    try:
        federation.register(*range(args.clients))
        for pid in range(args.clients):
            federation.start_node(pid, executor=executor, data_path=data / f"client-{pid}")
        time.sleep(args.settle)  # let the nodes connect and the warm workers import torch first
        groups = {f"site-{label}": node.pid for label, node in federation.supernodes.items()}
        groups["superlink"] = federation.superlink.pid
        idle = {label: memory.group_pss_mb(pgid) for label, pgid in groups.items()}
        idle_host = memory.host_used_mb() - host_before
        peaks = memory.GroupPeaks(groups, interval=5.0) if args.site_memory else None
        if peaks:
            peaks.start()
        out = work / "out"
        config = {**paper_config(args), "num-server-rounds": rounds, "output-dir": str(out)}
        run_id = federation.submit(" ".join(f"{k}={json.dumps(v)}" for k, v in config.items()))
        started = time.monotonic()
        wait_for_rounds(out, 1, args.timeout)
        # rounds 2..R-1: neither the first messages nor the final evaluation; the sampler reads
        # every process's /proc entry every 0.5 s, which costs the host about 0.1 cores
        with ProcessCpu() if args.cpu_profile else contextlib.nullcontext() as cpu:
            wait_for_rounds(out, max(1, rounds - 1), args.timeout - (time.monotonic() - started))
        wait_for_rounds(out, rounds, args.timeout - (time.monotonic() - started))
        if peaks:
            peaks.stop()
        status = federation.wait(run_id, timeout=120)
        if status != "finished:completed":
            raise RuntimeError(f"{executor} deployment run {status}:\n{federation.log(run_id)[-3000:]}")
        measured = max(1, rounds - 2)
        profile = {kind: seconds / measured for kind, seconds in cpu.seconds.items()} if cpu else {}
        footprint = site_memory(idle, idle_host, peaks, host_before) if args.site_memory else {}
        return rounds_of(out), profile, footprint
    finally:
        federation.close()


def site_memory(idle: dict[str, float], idle_host: float, peaks: memory.GroupPeaks | None,
                host_before: float) -> dict:
    """PSS of each site (its SuperNode's process group: the SuperNode, its executor and, during
    a run, the ClientApp worker) idle and at its peak during the run, the SuperLink's (with the
    ServerApp), the host's memory the federation took, and the sites that would fit in the
    host's memory at the largest site's peak."""
    def spread(values: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(values), 1), "max": round(max(values), 1)}

    sites = [label for label in idle if label.startswith("site-")]
    result: dict = {"idle_site_pss_mb": spread([idle[s] for s in sites]),
                    "idle_superlink_pss_mb": round(idle["superlink"], 1),
                    "idle_host_used_mb": round(idle_host, 1)}
    if peaks:
        training = [peaks.peak_pss[s] for s in sites]
        largest = max(training)
        superlink = peaks.peak_pss["superlink"]
        room = memory.host_total_mb() - host_before - superlink
        result.update({"training_site_pss_mb": spread(training), "training_superlink_pss_mb": round(superlink, 1),
                       "peak_host_used_mb": round(peaks.peak_host_used - host_before, 1),
                       "host_total_mb": round(memory.host_total_mb(), 1),
                       "sites_that_fit": int(room // largest)})
    return result


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``LABEL:KEY=VALUE,KEY=VALUE`` -> (label, environment overrides)."""
    label, separator, assignments = text.partition(":")
    pairs = [item.partition("=") for item in assignments.split(",") if item]
    if not label or not separator or not pairs or any(not key or not eq for key, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"a variant is LABEL:KEY=VALUE[,KEY=VALUE...], got {text!r}")
    return label, {key: value for key, _, value in pairs}


@contextlib.contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``overrides`` while the block runs (the federation's processes inherit it)."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def median_round(rounds: list[dict]) -> float:
    """Median wall time of rounds 2..R (round 1 includes first-message work in every setting)."""
    return statistics.median(float(r["seconds"]) for r in rounds[1:] or rounds)


_MESSAGE_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
import client_app.app as ca
from common.config import parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, client_routine
t_import = time.perf_counter() - t0 + float(sys.argv[2])

def message(cfg):
    t = {}
    s = time.perf_counter(); device = ca.select_device(cfg.device)
    model = ca.FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes).to(device)
    t["device set-up"] = time.perf_counter() - s
    s = time.perf_counter(); data = LocalData(*ca.client_tensors(cfg, 0, int(sys.argv[3]), device))
    t["data loading"] = time.perf_counter() - s
    s = time.perf_counter()
    client_routine(METHODS[cfg.strategy]).local_update(model, data, Received(), cfg, ca._generator(cfg, 1, 0))
    t["compute"] = time.perf_counter() - s
    s = time.perf_counter()
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=model.state_dict())})
    sum(len(o.deflate()) for o in get_all_nested_objects(content).values())
    t["reply"] = time.perf_counter() - s
    return t

cfg = parse_run_config(json.loads(sys.argv[1]))
cold = {"interpreter + imports": t_import, **message(cfg)}
warm = {"interpreter + imports": 0.0, **message(cfg)}
print(json.dumps({"cold": cold, "warm": warm}))
"""


def message_breakdown(args: argparse.Namespace) -> dict:
    """Seconds per part of one train message, in a fresh process (cold) and again in it (warm)."""
    started = time.perf_counter()
    interpreter = subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.perf_counter() - started  # the interpreter's own start-up, counted with imports
    del interpreter
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", _MESSAGE_PROBE, json.dumps(paper_config(args)), str(bare),
                             str(args.clients)], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--clients", type=int, default=20)
    cli.add_argument("--rounds", type=int, default=5)
    cli.add_argument("--cold-rounds", type=int, default=2, help="rounds of the cold-executor run (0: skip it)")
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--timeout", type=float, default=3600, help="seconds per deployment run")
    cli.add_argument("--round-timeout", type=float, default=600, help="the runs' round-timeout")
    cli.add_argument("--superlink-database", choices=("file", "memory"), default="file",
                     help="the SuperLink's state: an SQLite file (default) or in memory")
    cli.add_argument("--settle", type=float, default=60,
                     help="seconds between starting the SuperNodes and submitting the run")
    cli.add_argument("--host-slots", type=int, default=os.cpu_count() or 1,
                     help="trainings at once on this host (default: its cores; 0: no limit)")
    cli.add_argument("--cpu-profile", action="store_true",
                     help="also report each deployment's CPU seconds per round by kind of process "
                          "(the sampling costs the host about 0.1 cores: off for the ratio)")
    cli.add_argument("--site-memory", action="store_true",
                     help="also sample each site's and the SuperLink's memory (PSS) during the warm deployment's "
                          "rounds, every 5 s (reading /proc costs the host some CPU: off for the ratio)")
    cli.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                     help="also run the deployment with these environment variables (repeatable)")
    cli.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = cli.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # one torch thread per client, as in the simulation
    # N SuperNodes share this host's cores: training yields to the nodes' and the SuperLink's
    # network work (a host per site would not need this).
    os.environ.setdefault("FEDPAC_WORKER_NICE", "10")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fedpac-deploy-bench-"))
    try:
        results, settings = measure(args, work)
    except BaseException:
        print(f"the federations' files are kept for inspection in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    report(args, results, settings)


def measure(args: argparse.Namespace, work: Path) -> tuple[dict, list[str]]:
    """Run the simulation, the deployments and the message breakdown: the results, and the
    names of the settings whose rounds were timed."""
    results: dict = {"clients": args.clients, "rounds": args.rounds, "dataset": args.dataset,
                     "superlink_database": args.superlink_database, "host_slots": args.host_slots}
    data = export_partitions(args, work / "data")
    timed = {"simulation": simulate(args, work / "simulation")}
    timed["deployment"], profile, footprint = deploy(args, work / "warm", "warm", args.rounds, data)
    results["deployment"] = {"cpu_seconds_per_round": profile, "memory": footprint}
    if args.cold_rounds:
        try:
            timed["deployment, cold executor"], _, _ = deploy(args, work / "cold", "cold", args.cold_rounds, data)
        except RuntimeError as err:  # the "before" is a reference: its failure is reported, not fatal
            print(f"cold-executor deployment failed: {str(err)[:500]}")
    for number, (label, overrides) in enumerate(args.variant):
        with environment(overrides):
            name = f"deployment, {label}"
            timed[name], profile, _ = deploy(args, work / f"variant-{number}", "warm", args.rounds, data)
        results[name] = {"environment": overrides, "cpu_seconds_per_round": profile}
    for name, rounds in timed.items():
        results[name] = {**results.get(name, {}), "round_seconds": [float(r["seconds"]) for r in rounds],
                         "accuracy": [float(r["mean_accuracy"]) for r in rounds],
                         "median_round_seconds": median_round(rounds)}
    sim, dep = results["simulation"], results["deployment"]
    results["ratio"] = dep["median_round_seconds"] / sim["median_round_seconds"]
    for label, _ in args.variant:
        variant = results[f"deployment, {label}"]
        variant["ratio"] = variant["median_round_seconds"] / sim["median_round_seconds"]
    results["max_accuracy_difference"] = max(abs(a - b) for a, b in zip(sim["accuracy"], dep["accuracy"]))
    results["message_breakdown"] = message_breakdown(args)
    return results, list(timed)


def report(args: argparse.Namespace, results: dict, timed: list[str]) -> None:
    """Write deployment.json and deployment.csv and print the summary."""
    (args.out / "deployment.json").write_text(json.dumps(results, indent=2) + "\n")
    with open(args.out / "deployment.csv", "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(["setting", "median_round_seconds", "rounds", "final_accuracy"])
        for name in timed:
            writer.writerow([name, f"{results[name]['median_round_seconds']:.2f}",
                             len(results[name]["accuracy"]), f"{results[name]['accuracy'][-1]:.4f}"])
    for name in timed:
        print(f"{name:28s} median round {results[name]['median_round_seconds']:6.2f} s "
              f"over {len(results[name]['accuracy'])} rounds, accuracy by round "
              + " ".join(f"{100 * a:.2f}" for a in results[name]["accuracy"]))
    print(f"deployment / simulation: {results['ratio']:.2f}x (goal <= 1.3x); largest accuracy "
          f"difference {100 * results['max_accuracy_difference']:.4f} points")
    for label, _ in args.variant:
        print(f"deployment, {label} / simulation: {results[f'deployment, {label}']['ratio']:.2f}x")
    for name, result in results.items():
        if isinstance(result, dict) and result.get("cpu_seconds_per_round"):
            print(f"{name}: CPU seconds per round (rounds 2..R-1) "
                  + ", ".join(f"{kind} {seconds:.2f}" for kind, seconds in result["cpu_seconds_per_round"].items()))
    if results["deployment"]["memory"]:
        print("memory (MB): " + json.dumps(results["deployment"]["memory"]))
    for kind, parts in results["message_breakdown"].items():
        fixed = sum(v for k, v in parts.items() if k != "compute")
        print(f"{kind} message: " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items())
              + f" | fixed cost {fixed:.3f} s")


if __name__ == "__main__":
    main()
