"""The GPU kit's deployment: a SuperLink and N SuperNodes on this one host, one FedPAC run.

The same federation as ``bench/deployment.py``'s deployed run (``deploy/superlink.sh`` and
``deploy/supernode.sh``: TLS, SuperNode authentication, each node on its own data folder, its
ClientApp in a warm worker, driven by ``flwr run`` like a user's workstation), without the Ray
simulation beside it (the GPU machine has no Ray), on the device the run config names: all N
ClientApps share the host's one GPU. Reported in ``OUT/deployment.json``: the wall time from
``flwr run`` until the run finished, the rounds' own seconds, the final round's mean
personalized accuracy, the QP fallbacks, and the set-up time; the file is rewritten every few
seconds while the run goes on, so a run cut off by a time limit still says how far it got.

    python deploy/gpu/deploy_run.py --clients 20 --rounds 200 --device cuda \
        --data deploy/gpu/data/fashion-mnist-20 --out OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.deployment import FEDERATION, Federation, create_certificates, rounds_of, run_dir  # noqa: E402


class Stop(Exception):
    """SIGTERM/SIGINT: stop the federation and write what there is."""


def python_certificates(directory: Path, num_nodes: int) -> Path:
    """What ``deploy/certs.sh create`` makes (a CA, the SuperLink's certificate for localhost,
    an ECDSA P-256 key pair per SuperNode), made with ``cryptography`` (a Flower requirement)
    for a host without openssl or ssh-keygen."""
    # pylint: disable=import-outside-toplevel
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(key) -> bytes:  # noqa: ANN001
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    now = datetime.datetime.now(datetime.timezone.utc)
    (directory / "keys").mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "FedPAC federation CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=30))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA384()))
    link_key = ec.generate_private_key(ec.SECP384R1())
    names = [x509.DNSName("superlink"), x509.DNSName("localhost"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    link_cert = (x509.CertificateBuilder()
                 .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "superlink")]))
                 .issuer_name(ca_name).public_key(link_key.public_key())
                 .serial_number(x509.random_serial_number())
                 .not_valid_before(now - datetime.timedelta(minutes=5))
                 .not_valid_after(now + datetime.timedelta(days=30))
                 .add_extension(x509.SubjectAlternativeName(names), critical=False)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                 .sign(ca_key, hashes.SHA384()))
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (directory / "superlink.crt").write_bytes(link_cert.public_bytes(serialization.Encoding.PEM))
    (directory / "superlink.key").write_bytes(pem_key(link_key))
    for pid in range(num_nodes):
        key = ec.generate_private_key(ec.SECP256R1())  # as deploy/certs.sh: every request is signed
        private = directory / "keys" / f"supernode-{pid}"
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                              serialization.NoEncryption()))
        private.chmod(0o600)
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        private.with_suffix(".pub").write_bytes(public + f" supernode-{pid}\n".encode())
    (directory / "superlink.key").chmod(0o600)
    return directory


def certificates(directory: Path, num_nodes: int, how: str) -> tuple[Path, str]:
    if how == "auto":
        how = "certs.sh" if shutil.which("openssl") and shutil.which("ssh-keygen") else "python"
    if how == "certs.sh":
        return create_certificates(directory, num_nodes), how
    return python_certificates(directory, num_nodes), how


def data_folders(args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    """The clients' data folders: ``--data`` as built by make-wheelhouse.sh, else exported now
    (needs the Fashion-MNIST IDX files and Hugging Face datasets, as on a developer machine)."""
    from kit_data import export_compressed, read_manifest  # pylint: disable=import-outside-toplevel

    folder = args.data if args.data is not None else work / "data"
    manifest = read_manifest(folder)
    if manifest is None:
        if args.data is not None and not args.export_if_missing:
            raise SystemExit(f"deploy_run: {folder} has no manifest.json: build it with "
                             "deploy/gpu/make-wheelhouse.sh (or pass --export-if-missing)")
        print(f"exporting {args.clients} client data folders into {folder}", flush=True)
        manifest = export_compressed(args.data_config, args.clients, folder)
    if manifest["clients"] != args.clients:
        raise SystemExit(f"deploy_run: {folder} holds {manifest['clients']} clients' data, not {args.clients}")
    return folder, manifest


def summary(rounds: list[dict]) -> dict:
    seconds = [float(r["seconds"]) for r in rounds]
    return {
        "rounds_done": len(rounds),
        "final_accuracy": float(rounds[-1]["mean_accuracy"]) if rounds else None,
        "final_min_accuracy": float(rounds[-1]["min_accuracy"]) if rounds else None,
        "final_max_accuracy": float(rounds[-1]["max_accuracy"]) if rounds else None,
        "rounds_seconds_sum": sum(seconds),
        "first_round_seconds": seconds[0] if seconds else None,
        "median_round_seconds": statistics.median(seconds[1:] or seconds) if seconds else None,
        "qp_fallbacks": sum(int(float(r.get("qp_fallbacks") or 0)) for r in rounds),
        "accuracy_by_round": [float(r["mean_accuracy"]) for r in rounds],
        "round_seconds": seconds,
    }


def device_info(device: str) -> dict:
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch  # pylint: disable=import-outside-toplevel

        info["torch"] = torch.__version__
        if device == "cuda" and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def archive_logs(work: Path, out: Path, extra: dict[str, str]) -> None:
    """The federation's logs and the run's outputs (rounds.csv, metrics.json, ...) in one file."""
    with tarfile.open(out / "deployment-logs.tar.gz", "w:gz") as tar:
        for log in sorted(work.glob("*.log")):
            tar.add(log, arcname=f"logs/{log.name}")
        outputs = work / "out"
        if outputs.exists():
            for file in sorted(p for p in outputs.rglob("*") if p.is_file() and p.suffix != ".png"):
                tar.add(file, arcname=f"run/{file.relative_to(outputs)}")
        for name, text in extra.items():
            path = work / name
            path.write_text(text)
            tar.add(path, arcname=f"logs/{name}")


def main(argv: list[str] | None = None) -> int:  # noqa: C901  # one linear procedure
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--clients", type=int, default=20)
    cli.add_argument("--rounds", type=int, default=200)
    cli.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    cli.add_argument("--data", type=Path, help="client data folders (make-wheelhouse.sh); default: export now")
    cli.add_argument("--export-if-missing", action="store_true", help="export --data when it has no manifest")
    cli.add_argument("--data-config", default="",
                     help="run config overrides for an export (e.g. \"samples-per-client=100\")")
    cli.add_argument("--run-config", default="", help="extra run config, as for `flwr run --run-config`")
    cli.add_argument("--mixed-precision", action="store_true", help="bfloat16 autocast in the ClientApps")
    cli.add_argument("--database", choices=("memory", "file"), default="memory",
                     help="the SuperLink's state (default memory: superlink.sh --database memory)")
    cli.add_argument("--host-slots", type=int, default=None,
                     help="ClientApp calls training at once (default: 0 = no limit on cuda, the cores on cpu)")
    cli.add_argument("--certs", choices=("auto", "certs.sh", "python"), default="auto",
                     help="deploy/certs.sh (needs openssl, ssh-keygen) or the same made in Python")
    cli.add_argument("--settle", type=float, default=5.0, help="seconds after all nodes are online")
    cli.add_argument("--timeout", type=float, default=3600.0,
                     help="seconds for the whole run; then stop and report the rounds done")
    cli.add_argument("--round-timeout", type=float, default=600.0)
    cli.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "deploy" / "gpu" / "out"))
    cli.add_argument("--keep-work", action="store_true", help="keep the temporary federation folder")
    args = cli.parse_args(argv)
    from flwr.common.config import parse_config_args  # pylint: disable=import-outside-toplevel

    args.data_config = parse_config_args([args.data_config]) if args.data_config else {}
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.timeout

    def on_signal(signum, _frame):  # noqa: ANN001
        raise Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # Outside the repository: `flwr run .` packs the repository's *.json/*.toml into the FAB.
    work = Path(tempfile.mkdtemp(prefix="fedpac-gpu-kit-"))
    slots = args.host_slots if args.host_slots is not None else (0 if args.device == "cuda" else os.cpu_count() or 1)
    os.environ.update({
        "OMP_NUM_THREADS": "1",  # one torch thread per process, as bench/deployment.py
        "FEDPAC_HOST_SLOTS": str(slots), "FEDPAC_HOST_SLOTS_DIR": str(work / "slots"),
        "PYTHONUNBUFFERED": "1",
    })
    if args.device == "cpu":  # the nodes' CPU training yields to the SuperLink and SuperNodes
        os.environ.setdefault("FEDPAC_WORKER_NICE", "10")

    result: dict = {
        "status": "starting", "clients": args.clients, "rounds": args.rounds, "device": args.device,
        "mixed_precision": args.mixed_precision, "superlink_database": args.database, "host_slots": slots,
        "machine": device_info(args.device),
    }
    report = args.out / "deployment.json"

    def write() -> None:
        result["elapsed_seconds"] = time.monotonic() - started
        report.write_text(json.dumps(result, indent=1) + "\n")

    federation = None
    run_id = ""
    try:
        data, manifest = data_folders(args, work)
        result["data"] = {"folder": str(data), **{k: manifest[k] for k in ("run_config", "samples")}}
        certs, how = certificates(work / "certs", args.clients, args.certs)
        result["certificates"] = how
        write()
        print(f"SuperLink + {args.clients} SuperNodes ({args.device}, host slots {slots}) in {work}", flush=True)
        federation = Federation(work, certs, args.clients, database=args.database)
        federation.register(*range(args.clients))
        for pid in range(args.clients):
            federation.start_node(pid, data_path=data / f"client-{pid}")
        result["nodes_online_seconds"] = federation.wait_online(args.clients, max(60.0, deadline - time.monotonic()))
        time.sleep(args.settle)
        result["setup_seconds"] = time.monotonic() - started
        print(f"{args.clients} SuperNodes online after {result['nodes_online_seconds']:.1f} s", flush=True)

        outputs = work / "out"
        config = {**manifest["run_config"], "num-server-rounds": args.rounds, "min-available-clients": args.clients,
                  "round-timeout": args.round_timeout, "device": args.device,
                  "mixed-precision": args.mixed_precision, "output-dir": str(outputs),
                  **(parse_config_args([args.run_config]) if args.run_config else {})}
        result["run_config"] = config
        submitted = time.monotonic()
        run_id = federation.submit(" ".join(f"{k}={json.dumps(v)}" for k, v in config.items()))
        result["run_id"], result["status"] = run_id, "running"
        write()
        # Progress from the run's rounds.csv on disk; `flwr ls` (a process start) only now and then.
        last_print, last_status = 0, time.monotonic()
        while time.monotonic() < deadline:
            rounds = rounds_of(outputs)
            result.update(summary(rounds))
            result["run_wall_seconds"] = time.monotonic() - submitted
            write()
            if len(rounds) >= args.rounds:
                break
            if len(rounds) != last_print:
                last_print = len(rounds)
                print(f"round {len(rounds)}/{args.rounds}: mean accuracy {100 * result['final_accuracy']:.2f} %, "
                      f"{result['run_wall_seconds']:.0f} s since flwr run", flush=True)
            if time.monotonic() - last_status > 15:
                last_status = time.monotonic()
                if federation.status(run_id).startswith("finished"):
                    break
            time.sleep(0.5)
        status, until = federation.status(run_id), min(deadline, time.monotonic() + 60)
        while not status.startswith("finished") and time.monotonic() < until:
            time.sleep(0.5)
            status = federation.status(run_id)
        result.update(summary(rounds_of(outputs)))
        result["run_wall_seconds"] = time.monotonic() - submitted
        result["run_status"] = status
        complete = status == "finished:completed" and result["rounds_done"] >= args.rounds
        result["status"] = "completed" if complete else ("timed out" if time.monotonic() >= deadline else "failed")
        try:
            result["outputs"] = str(run_dir(outputs))
        except (ValueError, FileNotFoundError):
            pass
        return 0 if complete else 1
    except Stop as stop:
        result["status"] = f"stopped by {stop}"
        return 1
    except Exception as err:  # the report says what broke; the caller sees the status
        result["status"] = "failed"
        result["error"] = f"{type(err).__name__}: {err}"[-4000:]
        raise
    finally:
        result["total_wall_seconds"] = time.monotonic() - started
        write()
        extra = {}
        if federation is not None:
            if run_id:
                try:
                    extra["flwr-log.txt"] = federation.flwr_result("log", run_id, FEDERATION, "--show",
                                                                   timeout=30).stdout
                except Exception as err:  # pylint: disable=broad-except  # the log is a courtesy
                    extra["flwr-log.txt"] = f"flwr log failed: {err}"
            federation.close()
        archive_logs(work, args.out, extra)
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({k: v for k, v in result.items() if k not in ("accuracy_by_round", "round_seconds")},
                         indent=1), flush=True)


if __name__ == "__main__":
    sys.exit(main())
