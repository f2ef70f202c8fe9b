"""deploy/supernode.sh (issue 14, item 5): a bad argument is named in one line (exit status 2,
no usage dump, no source line), and a failure that a restart cannot heal stops the node at once
while one that can heal is restarted.

A fake ``flower-supernode`` earlier on PATH (and a fake ``python`` beside it, which the warm
executor path calls) plays Flower's part. Like Flower 1.39's ``flwr_exit`` it logs
``Exit Code: <code>`` and the cause on stderr and exits with status 1 (a process cannot exit with
302 or 305: Flower exits with 1 for every error code and names the code in its log); the messages
are the ones flower-supernode prints for an unparsable key, a wrong CA and a SuperLink that refuses
to activate the node.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "supernode.sh"
sys.path.insert(0, str(ROOT / "deploy"))
import warm_executor  # noqa: E402  pylint: disable=wrong-import-position

FAKE_NODE = r"""#!/usr/bin/env bash
# One behaviour per start from $FAKE_PLAN (space-separated; the last one repeats).
n=$(( $(cat "$FAKE_DIR/starts" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$FAKE_DIR/starts"
printf '%s\n' "$@" > "$FAKE_DIR/args-$n"
read -ra plan <<< "$FAKE_PLAN"
i=$(( n <= ${#plan[@]} ? n - 1 : ${#plan[@]} - 1 ))
echo 'INFO :      Starting Flower SuperNode' >&2
flower_exit() { printf '\033[91mERROR \033[0m:     Exit Code: %s\n%s\n' "$1" "$2" >&2; exit 1; }
case "${plan[$i]}" in
  ok) exit 0 ;;
  crash) echo 'Traceback (most recent call last):' >&2; exit 1 ;;
  key) flower_exit 302 'Unable to parse the private key file.
Node authentication requires elliptic curve private key.' ;;
  tls) flower_exit 305 'Failed to initialize the connection to the SuperLink.
failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9092: Tls handshake failed '\
'(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: '\
'unable to get local issuer certificate: OK
The SuperNode could not establish a connection to the SuperLink.' ;;
  port) printf '%s\n' "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 9094): "\
"address already in use" \
         'Traceback (most recent call last):' 'RuntimeError: SuperNode Runtime HTTP API failed to start.' >&2; exit 1 ;;
  busy) flower_exit 305 'Failed to initialize the connection to the SuperLink.
[code: 2004] Failed to activate SuperNode.
The SuperNode could not establish a connection to the SuperLink.' ;;
esac
"""

FAKE_PYTHON = """#!/usr/bin/env bash
case "${1:-}" in
  */fast_supernode.py) shift; exec "$(dirname "$0")/flower-supernode" "$@" ;;
  */warm_executor.py) [ -n "${FAKE_EXECUTOR_GONE:-}" ] || exec sleep 60 ;;
  *) exec "%s" "$@" ;;
esac
""" % sys.executable

SOURCE_LINE = re.compile(r"line \d+|^\s*#|set -euo|\$\d|\[ -")


@pytest.fixture
def site(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("flower-supernode", FAKE_NODE), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    key = tmp_path / "supernode-0"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n")
    (tmp_path / "supernode-0.pub").write_text("ecdsa-sha2-nistp384 AAAAE2VjZHNh supernode-0\n")
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "notes.txt").write_text("not a key, not a certificate\n")
    return tmp_path


def base_args(site: Path, **changes: str | None) -> list[str]:
    options = {"--superlink": "127.0.0.1:9092", "--ca": str(site / "ca.crt"), "--key": str(site / "supernode-0"),
               "--partition-id": "0", "--num-partitions": "2", "--model-dir": str(site / "models"),
               "--port": "9094", "--executor": "cold", "--restart-delay": "0.05"}
    for option, value in changes.items():
        option = "--" + option.replace("_", "-")
        options.pop(option, None)
        if value is not None:
            options[option] = value
    return [part for option, value in options.items() for part in (option, value)]


def run(site: Path, args: list[str], plan: str = "ok", timeout: float = 15,
        **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{site / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "FAKE_DIR": str(site), "FAKE_PLAN": plan, **env_vars}
    try:
        return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"supernode.sh still running after {timeout} s (restarting a failure that cannot heal?): "
                    f"{err.stderr!r}")


def starts(site: Path) -> int:
    path = site / "starts"
    return int(path.read_text()) if path.exists() else 0


BAD_ARGUMENTS = {
    "key does not exist": ({"key": "{site}/no-such-key"}, "--key", "no such file"),
    "key is a directory": ({"key": "{site}/data"}, "--key", "not a file"),
    "key is not a private key": ({"key": "{site}/notes.txt"}, "--key", "not an OpenSSH private key"),
    "key is the public half": ({"key": "{site}/supernode-0.pub"}, "--key", "public key"),
    "ca does not exist": ({"ca": "{site}/no-ca.crt"}, "--ca", "no such file"),
    "ca is not a certificate": ({"ca": "{site}/notes.txt"}, "--ca", "not a PEM certificate"),
    "root-certificates does not exist": ({"ca": None, "root_certificates": "{site}/no-ca.crt"},
                                         "--root-certificates", "no such file"),
    "data path does not exist": ({"data_path": "{site}/no-data"}, "--data-path", "no such directory"),
    "data path is a file": ({"data_path": "{site}/notes.txt"}, "--data-path", "not a directory"),
    "model dir is a file": ({"model_dir": "{site}/notes.txt"}, "--model-dir", "not a directory"),
    "superlink missing": ({"superlink": None}, "--superlink", "required"),
    "superlink without port": ({"superlink": "fedpac.example.org"}, "--superlink", "HOST:PORT"),
    "key missing": ({"key": None}, "--key", "required"),
    "partition id not a number": ({"partition_id": "first"}, "--partition-id", "integer"),
    "num partitions zero": ({"num_partitions": "0"}, "--num-partitions", "integer"),
    "port out of range": ({"port": "70000"}, "--port", "1-65535"),
    "restarts not a number": ({"restarts": "many"}, "--restarts", "integer"),
    "restart delay not a number": ({"restart_delay": "soon"}, "--restart-delay", "seconds"),
    "executor unknown": ({"executor": "hot"}, "--executor", "warm or cold"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_a_bad_argument_is_named_in_one_line(site, case):
    changes, option, problem = BAD_ARGUMENTS[case]
    changes = {k: v if v is None else v.format(site=site) for k, v in changes.items()}
    result = run(site, base_args(site, **changes))
    assert_one_line_error(result, option, problem)


@pytest.mark.parametrize("args, option, problem", [
    (["--superlink", "127.0.0.1:9092", "--frobnicate", "1"], "--frobnicate", "unknown option"),
    (["stray"], "stray", "unexpected argument"),
    (["--superlink", "127.0.0.1:9092", "--key"], "--key", "needs a value"),
    (["--key", "--partition-id", "0"], "--key", "needs a value"),
    (["--data-path", ""], "--data-path", "needs a value"),
])
def test_an_unknown_option_or_a_missing_value_is_named_in_one_line(site, args, option, problem):
    assert_one_line_error(run(site, args), option, problem)


def test_the_line_reads_as_option_value_problem(site):
    result = run(site, base_args(site, partition_id="first"))
    assert result.stderr == "supernode.sh: --partition-id first: not a non-negative integer\n"
    result = run(site, base_args(site, num_partitions=None))
    assert result.stderr.startswith("supernode.sh: --num-partitions is required (")


def assert_one_line_error(result: subprocess.CompletedProcess, option: str, problem: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr  # no usage dump
    assert lines[0].startswith(f"supernode.sh: {option}"), lines[0]
    assert problem in lines[0], lines[0]
    assert not SOURCE_LINE.search(lines[0]), lines[0]
    assert result.stdout == ""


def test_help_prints_the_usage_and_no_source_line(site):
    result = run(site, ["--help"])
    assert result.returncode == 0, result.stderr
    assert "--superlink HOST:9092" in result.stdout and "--restart-delay" in result.stdout
    assert "set -euo" not in result.stdout and not any(line.startswith("#") for line in result.stdout.splitlines())


def test_the_node_gets_the_files_and_config(site):
    result = run(site, base_args(site, data_path=str(site / "data")))
    assert result.returncode == 0, result.stderr
    args = (site / "args-1").read_text().splitlines()
    assert args[args.index("--root-certificates") + 1] == str(site / "ca.crt")
    assert args[args.index("--auth-supernode-private-key") + 1] == str(site / "supernode-0")
    assert f'data-path="{site / "data"}"' in args[args.index("--node-config") + 1]
    assert (site / "models").is_dir()


def test_the_site_s_privacy_policy_reaches_its_node_config_and_nothing_else_does(site):
    """--privacy-policy adds the site's own policy keys to its node config; anything else (a
    partition of its choosing, a value that is not one) is refused in one line."""
    policy = "dp-required=true dp-epsilon-budget=8 dp-min-noise-multiplier=0.8 dp-max-delta=1e-5 withhold-metrics=true"
    result = run(site, [*base_args(site), "--privacy-policy", policy])
    assert result.returncode == 0, result.stderr
    args = (site / "args-1").read_text().splitlines()
    assert args[args.index("--node-config") + 1].endswith(policy)
    for bad in ("partition-id=3", "dp-required=yes", "dp-epsilon-budget=8;x", "*", "dp-noise-secret=00",
                "withhold-metrics=1"):
        assert_one_line_error(run(site, [*base_args(site), "--privacy-policy", bad]), "--privacy-policy",
                              "is not one of")


DIGEST_A, DIGEST_B = "a" * 63 + "0", "0123456789abcdef" * 4


def test_the_site_s_approved_apps_reach_its_node_config_as_the_executor_reads_them(site):
    """--approved-apps: the digests, lower case and comma-separated, in the node config's
    approved-apps, which Flower parses into the string the warm executor checks each FAB against."""
    result = run(site, [*base_args(site, executor="warm"), "--approved-apps", f"{DIGEST_A.upper()}, {DIGEST_B}"])
    assert result.returncode == 0, result.stderr
    args = (site / "args-1").read_text().splitlines()
    node_config = args[args.index("--node-config") + 1]
    assert f'approved-apps="{DIGEST_A},{DIGEST_B}"' in node_config
    parsed = parse_config_args([node_config])
    assert parsed["approved-apps"] == f"{DIGEST_A},{DIGEST_B}" and parsed["partition-id"] == 0
    assert warm_executor.approved_apps_of(parsed) == {DIGEST_A, DIGEST_B}


def test_without_approved_apps_the_node_config_has_none(site):
    result = run(site, base_args(site, executor="warm"))
    assert result.returncode == 0, result.stderr
    args = (site / "args-1").read_text().splitlines()
    assert "approved-apps" not in args[args.index("--node-config") + 1]


def test_the_cold_executor_refuses_to_start_with_approved_apps(site):
    """Flower's own flwr-clientapp would run any app: a site that pins its app versions must not
    believe it does when it cannot."""
    result = run(site, [*base_args(site, executor="cold"), "--approved-apps", DIGEST_A])
    assert_one_line_error(result, "--approved-apps", "needs --executor warm")
    assert starts(site) == 0  # no node was started


@pytest.mark.parametrize("bad, problem", [
    (DIGEST_A[:-1], "is not a SHA-256 digest"),
    (f"{DIGEST_A};{DIGEST_B}", "is not a SHA-256 digest"),
    (f"sha256:{DIGEST_A}", "is not a SHA-256 digest"),
    (f"{DIGEST_A},{DIGEST_B[:-1]}g", "is not a SHA-256 digest"),
    (",", "lists no digest"),
])
def test_an_approved_apps_value_that_is_not_a_list_of_digests_is_named_in_one_line(site, bad, problem):
    result = run(site, [*base_args(site, executor="warm"), "--approved-apps", bad])
    assert_one_line_error(result, "--approved-apps", problem)
    assert starts(site) == 0


def test_the_approved_apps_are_not_a_privacy_policy_entry(site):
    result = run(site, [*base_args(site), "--privacy-policy", f"approved-apps={DIGEST_A}"])
    assert_one_line_error(result, "--privacy-policy", "--approved-apps")


@pytest.mark.parametrize("executor", ["cold", "warm"])
@pytest.mark.parametrize("plan, code, fix", [("key", "302", "certs.sh create"), ("tls", "305", "--ca")])
def test_a_permanent_flower_exit_code_stops_at_once(site, executor, plan, code, fix):
    result = run(site, base_args(site, executor=executor, restarts="18"), plan=plan)
    assert result.returncode == 1, result.stderr
    assert starts(site) == 1, result.stderr  # not restarted
    assert "restart 1/" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("supernode.sh: ") and f"exit code {code}" in last and fix in last, last
    assert "Exit Code: " + code in result.stderr  # Flower's own message still reaches the log
    if plan == "tls":
        assert "(unable to get local issuer certificate)" in last, last


@pytest.mark.parametrize("executor", ["cold", "warm"])
def test_a_taken_runtime_port_stops_at_once_and_names_the_port(site, executor):
    # two SuperNodes of one host given the same --port: the second would restart into it forever
    result = run(site, base_args(site, executor=executor, restarts="18"), plan="port")
    assert result.returncode == 1, result.stderr
    assert starts(site) == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("supernode.sh: ") and "port 9094" in last and "taken" in last and "--port" in last, last


@pytest.mark.parametrize("executor", ["cold", "warm"])
def test_a_failure_that_heals_is_restarted_until_the_node_runs(site, executor):
    result = run(site, base_args(site, executor=executor, restarts="5"), plan="busy crash ok")
    assert result.returncode == 0, result.stderr
    assert starts(site) == 3
    assert "restart 1/5" in result.stderr and "restart 2/5" in result.stderr
    assert "Failed to activate SuperNode" in result.stderr  # Flower's output is passed through


def test_a_warm_executor_that_already_ended_does_not_stop_the_restarts(site):
    # it watches the node and may exit before the script stops it: that is no reason to give up
    result = run(site, base_args(site, executor="warm", restarts="5"), plan="busy ok", FAKE_EXECUTOR_GONE="1")
    assert result.returncode == 0, result.stderr
    assert starts(site) == 2, result.stderr


@pytest.mark.parametrize("plan", ["busy", "crash"])
def test_restarts_are_bounded(site, plan):
    result = run(site, base_args(site, restarts="2"), plan=plan)
    assert result.returncode == 1, result.stderr
    assert starts(site) == 3
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("supernode.sh: ") and "no restarts left" in last, last
    if plan == "busy":  # an unregistered key looks the same to the node: say so
        assert "certs.sh register" in last, last


def test_no_restarts_means_no_restart(site):
    result = run(site, base_args(site, restarts="0"), plan="busy")
    assert result.returncode == 1 and starts(site) == 1, result.stderr
    assert "Failed to activate SuperNode" in result.stderr


def test_a_node_that_ends_by_itself_is_not_restarted_and_the_site_is_told_why(site):
    """Flower's SuperNode stops itself (status 0) when the SuperLink refuses its key, as after
    `flwr supernode unregister`: the script says so once and does not start it again."""
    result = run(site, base_args(site, restarts="5"), plan="ok")
    assert result.returncode == 0
    assert result.stderr.count("no longer accepts this node's key") == 1
    assert "restart" not in result.stderr.replace("not restarting", "")
