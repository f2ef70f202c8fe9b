"""deploy/superlink.sh, quickly: what it starts is the guarded launcher, with TLS, SuperNode
authentication and the Control API on this host only, whatever a careless operator leaves out.

The deployment tests show these properties over real connections (``tests/test_deployment.py``,
``tests/test_site_identity.py``); these fail in seconds when the script stops asking for them. A
fake ``flower-superlink`` earlier on PATH, and the fake ``python`` beside it that the script
calls, record the command line instead of starting anything.
"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "superlink.sh"
RECORDING_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_DIR/args"
"""


@pytest.fixture
def host(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("flower-superlink", "#!/usr/bin/env bash\nexit 0\n"), ("python", RECORDING_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    certs = tmp_path / "certs"
    certs.mkdir()
    for name in ("ca.crt", "superlink.crt", "superlink.key"):
        (certs / name).write_text("-----BEGIN PLACEHOLDER-----\n")
    return tmp_path


def _start(host: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    result = subprocess.run(["bash", str(SCRIPT), *args], cwd=host, capture_output=True, text=True, timeout=60,
                            env={"PATH": f"{host / 'bin'}:/usr/bin:/bin", "FAKE_DIR": str(host)})
    recorded = host / "args"
    return result, recorded.read_text().splitlines() if recorded.exists() else []


def _value(args: list[str], option: str) -> str:
    return args[args.index(option) + 1]


def test_the_superlink_runs_the_guarded_launcher_with_tls_node_auth_and_a_loopback_control_api(host):
    result, args = _start(host, "--certs", "certs")
    assert result.returncode == 0, result.stderr
    # the launcher that installs the Fleet guard and the size guard (tests/test_fleet_guard.py)
    assert args[0] == str(ROOT / "deploy" / "patient_superlink.py")
    certs = (host / "certs").resolve()
    assert [_value(args, f"--ssl-{kind}") for kind in ("ca-certfile", "certfile", "keyfile")] == \
        [str(certs / "ca.crt"), str(certs / "superlink.crt"), str(certs / "superlink.key")]
    assert "--insecure" not in args
    assert "--enable-supernode-auth" in args
    assert (_value(args, "--host"), _value(args, "--port")) == ("127.0.0.1", "9093")
    assert _value(args, "--fleet-api-address") == "0.0.0.0:9092"


def test_the_control_api_leaves_the_host_only_when_the_operator_says_so(host):
    _, args = _start(host, "--certs", "certs", "--control-address", "10.0.0.5:9093")
    assert (_value(args, "--host"), _value(args, "--port")) == ("10.0.0.5", "9093")
    assert "--enable-supernode-auth" in args and "--insecure" not in args


@pytest.mark.parametrize("missing", ["ca.crt", "superlink.crt", "superlink.key"])
def test_a_superlink_without_its_certificates_does_not_start(host, missing):
    (host / "certs" / missing).unlink()
    result, args = _start(host, "--certs", "certs")
    assert result.returncode == 2 and f"certs/{missing} missing" in result.stderr
    assert args == []
