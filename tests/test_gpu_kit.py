"""The GPU kit (deploy/gpu/): its wheel list, its certificates without openssl, and its CPU dry
run end to end (install skipped: this interpreter already has the project's requirements)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.deployment import ROOT
from tests.prerequisites import require_fashion_mnist

KIT = ROOT / "deploy" / "gpu"
sys.path.insert(0, str(KIT))


def test_wheelhouse_lists_the_app_s_runtime_without_what_the_gpu_image_has_or_the_kit_never_imports():
    listed = subprocess.run(["bash", str(KIT / "make-wheelhouse.sh"), "--list"], check=True,
                            capture_output=True, text=True).stdout.split()
    assert {"flwr", "grpcio", "cryptography", "cvxpy", "clarabel", "datasets", "flwr-datasets",
            "threadpoolctl", "hatchling"} <= set(listed)
    # too big for 64 MiB and either on the image (torch, numpy, scipy, pyarrow, matplotlib, ...)
    # or never imported by the kit (uv, ray, cvxpy's other solvers)
    assert not {"torch", "torchvision", "numpy", "scipy", "pyarrow", "pandas", "matplotlib", "pillow",
                "uv", "ray", "scs", "osqp", "highspy", "sparsediffpy"} & set(listed)
    assert len(listed) == len(set(listed))


def test_kit_scripts_explain_themselves_and_refuse_unknown_options():
    for script in ("make-wheelhouse.sh", "run-kit.sh"):
        shown = subprocess.run(["bash", str(KIT / script), "--help"], check=True, capture_output=True, text=True)
        assert "deploy/gpu/" in shown.stdout
    refused = subprocess.run(["bash", str(KIT / "run-kit.sh"), "--device", "tpu"], capture_output=True, text=True)
    assert refused.returncode == 2


def test_built_kit_folders_are_ignored_by_git():
    for path in ("deploy/gpu/wheels/x.whl", "deploy/gpu/data/x", "deploy/gpu/out/x", "deploy/gpu/.venv/x"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path


def test_python_certificates_are_what_certs_sh_makes(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from deploy_run import python_certificates

    certs = python_certificates(tmp_path, 2)
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    link = x509.load_pem_x509_certificate((certs / "superlink.crt").read_bytes())
    assert link.issuer == ca.subject
    link.verify_directly_issued_by(ca)
    names = link.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    for pid in range(2):
        key = load_ssh_private_key((certs / "keys" / f"supernode-{pid}").read_bytes(), password=None)
        public = load_ssh_public_key((certs / "keys" / f"supernode-{pid}.pub").read_bytes())
        assert key.public_key().public_numbers() == public.public_numbers()
        assert key.curve.name == "secp256r1"
        assert (certs / "keys" / f"supernode-{pid}").stat().st_mode & 0o077 == 0


@pytest.mark.e2e
def test_kit_dry_run_deploys_benches_and_reports(tmp_path):
    require_fashion_mnist()
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    result = subprocess.run(["bash", str(KIT / "run-kit.sh"), "--dry-run", "--python", sys.executable],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = json.loads((out / "kit.json").read_text())
    assert summary["dry_run"] is True
    assert summary["steps"] == {"imports": 0, "tests": 0, "bench": 0, "deploy": 0}
    assert summary["client_update"]["device"] == "cpu"
    assert summary["client_update"]["fedpac_samples_per_s"] > 0

    deployment = json.loads((out / "deployment.json").read_text())
    assert deployment["status"] == "completed"
    assert deployment["run_status"] == "finished:completed"
    assert deployment["clients"] == 3 and deployment["device"] == "cpu"
    assert deployment["rounds_done"] == 2 == len(deployment["accuracy_by_round"])
    assert 0.0 <= deployment["final_accuracy"] <= 1.0
    assert deployment["run_wall_seconds"] > 0 and deployment["rounds_seconds_sum"] > 0
    assert deployment["run_wall_seconds"] >= deployment["rounds_seconds_sum"]
    assert deployment["data"]["samples"]["train"] == [100, 100, 100]
    assert (out / "deployment-logs.tar.gz").stat().st_size > 0
    assert "every step passed" in (out / "kit.log").read_text()
