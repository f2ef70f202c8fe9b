#!/usr/bin/env bash
# The GPU kit: on a machine with an NVIDIA GPU, Python 3.12 and torch + torchvision (no flwr, no
# network), install FedPAC from the carried wheels, then measure it there.
#   deploy/gpu/run-kit.sh [--device cuda|cpu] [--rounds R] [--clients N] [--dry-run]
#                         [--steps install,tests,bench,deploy] [--python PY] [--repeats K]
#                         [--deploy-timeout S] [--deploy-mixed-precision] [--database memory|file]
#                         [--host-slots N] [--wheels DIR] [--data DIR]
#   steps (default: all four, in this order)
#     install  a venv deploy/gpu/.venv (--system-site-packages, and the base interpreter's own
#              site-packages when that is itself a venv, for its torch), the wheels of --wheels
#              (default deploy/gpu/wheels; make-wheelhouse.sh) with --no-index --no-deps, then
#              the project (pip install --no-deps --no-build-isolation -e .); skipped when
#              that venv already holds these wheels, or with --python
#     tests    the tests that mention CUDA (none is a finding, not a failure)
#     bench    bench/client_update.py --device D, without and with --mixed-precision
#     deploy   deploy/gpu/deploy_run.py: SuperLink + N SuperNodes on this host (TLS, node
#              authentication, warm executors), Fashion-MNIST paper protocol, R rounds, every
#              ClientApp on device D; wall time and final accuracy
#   --dry-run  the whole kit, tiny, on the CPU (3 clients, 2 rounds of 100-sample clients,
#              1 local epoch, 1 bench repeat without mixed precision, data exported here), with
#              an interpreter that has the project's requirements: --python, else the
#              project's .venv (no install)
#   --python PY            run with PY as it is (no venv, no install)
#   KIT_BASE_PYTHON        the interpreter with torch that the venv builds on (default python3)
# Writes under $OUT (default deploy/gpu/out): kit.log, kit.json (summary), client_update.json,
# client_update_amp.json, deployment.json, deployment-logs.tar.gz, tests.xml.
# On the device machine (10 minutes a command): one call with --steps install,tests,bench,
# another with --steps install,deploy --deploy-timeout 500 (the venv stays while it is warm).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
device="" rounds="" clients="" dry=0 steps="install,tests,bench,deploy" python="" repeats=""
deploy_timeout=3600 deploy_amp=0 database="memory" host_slots="" wheels="$here/wheels" data=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --steps) steps="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --repeats) repeats="$2"; shift 2 ;;
    --deploy-timeout) deploy_timeout="$2"; shift 2 ;;
    --deploy-mixed-precision) deploy_amp=1; shift ;;
    --database) database="$2"; shift 2 ;;
    --host-slots) host_slots="$2"; shift 2 ;;
    --wheels) wheels="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "run-kit.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
if [ "$dry" = 1 ]; then
  device="${device:-cpu}" clients="${clients:-3}" rounds="${rounds:-2}" repeats="${repeats:-1}"
else
  device="${device:-cuda}" clients="${clients:-20}" rounds="${rounds:-200}" repeats="${repeats:-5}"
fi
case "$device" in cuda|cpu) ;; *) echo "run-kit.sh: --device is cuda or cpu" >&2; exit 2 ;; esac
for step in ${steps//,/ }; do
  case "$step" in install|tests|bench|deploy) ;; *) echo "run-kit.sh: unknown step $step" >&2; exit 2 ;; esac
done
has_step() { [[ ",$steps," == *",$1,"* ]]; }

OUT="${OUT:-$here/out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export OUT PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/kit.log") 2>&1
tee_pid=$!
trap 'exec 1>&- 2>&-; wait "$tee_pid" 2>/dev/null || true' EXIT  # kit.log complete when this exits
log() { printf '\n== [%s] run-kit: %s\n' "$(date +%H:%M:%S)" "$*"; }
started=$(date +%s)
log "device $device, $clients clients, $rounds rounds, steps $steps$([ "$dry" = 1 ] && echo ', dry run'); OUT=$OUT"

# The interpreter: --python as it is; a dry run's default is the project's .venv; else the kit venv.
venv="$here/.venv"
if [ -z "$python" ] && [ "$dry" = 1 ] && [ -x "$root/.venv/bin/python" ] \
    && "$root/.venv/bin/python" -c 'import flwr' 2>/dev/null; then
  python="$root/.venv/bin/python"
fi
if [ -n "$python" ]; then
  py="$python"
  steps="$(echo ",$steps," | sed 's/,install,/,/; s/^,//; s/,$//')"
  log "interpreter $py as it is (no install)"
else
  py="$venv/bin/python"
fi

declare -A status=()
failed=0
run_step() {  # name command...: runs in a subshell with errexit; records its status
  local name="$1" rc
  shift
  log "step $name"
  set +e
  ( set -euo pipefail; "$@" )
  rc=$?
  set -e
  status[$name]=$rc
  if [ "$rc" != 0 ]; then
    failed=1
    log "step $name FAILED (status $rc)"
  else
    log "step $name done"
  fi
  return 0
}

step_install() {
  local base="${KIT_BASE_PYTHON:-python3}" marker stamp site
  "$base" -c 'import sys, torch; print(f"base interpreter {sys.executable}: Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")' \
    || { echo "install: $base has no torch (set KIT_BASE_PYTHON)"; return 1; }
  ls "$wheels"/*.whl >/dev/null 2>&1 || { echo "install: no wheels in $wheels (deploy/gpu/make-wheelhouse.sh, then carry deploy/gpu/wheels)"; return 1; }
  marker="$venv/.kit-wheels"
  stamp="$(cd "$wheels" && ls -1 ./*.whl | sha256sum | cut -c1-16)"
  if [ -x "$py" ] && [ -f "$marker" ] && [ "$(cat "$marker")" = "$stamp" ]; then
    echo "install: $venv already holds these wheels"
    return 0
  fi
  if [ ! -x "$py" ]; then
    "$base" -m venv --system-site-packages "$venv" 2>/dev/null \
      || { rm -rf "$venv"; "$base" -m venv --system-site-packages --without-pip "$venv"; }
  fi
  # A base interpreter that is itself a venv (the GPU image's python3 is /opt/torch/.venv/bin/python3):
  # --system-site-packages reaches its base's packages, not its own, so name those too.
  if ! "$py" -c 'import torch' 2>/dev/null; then
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$base" -c 'import site, sysconfig; print("\n".join(dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])))' \
      > "$site/_kit_base_site.pth"
    echo "install: the venv sees $base's packages through $site/_kit_base_site.pth"
    "$py" -c 'import torch' || { echo "install: torch still not importable in $venv"; return 1; }
  fi
  local pip=("$py" -m pip)
  "$py" -m pip --version >/dev/null 2>&1 || pip=("$base" -m pip --python "$py")
  echo "install: $(ls "$wheels"/*.whl | wc -l) wheels from $wheels"
  "${pip[@]}" install --quiet --no-index --no-deps --no-compile --disable-pip-version-check "$wheels"/*.whl
  "${pip[@]}" install --quiet --no-index --no-deps --no-build-isolation --disable-pip-version-check -e "$root"
  # Left out on purpose (deploy/gpu/requirements.txt): uv, ray, cvxpy's other solvers.
  echo "install: pip check (uv, scs, osqp, highspy, sparsediffpy are left out on purpose):"
  "${pip[@]}" check 2>&1 | sed 's/^/  /' || true
  echo "$stamp" > "$marker"
}

step_smoke() {  # what every later step imports, from the interpreter they use
  (cd "$root" && "$py" - <<'EOF'
import importlib, sys
versions = {}
for name in ("torch", "numpy", "flwr", "grpc", "cvxpy", "datasets", "flwr_datasets", "matplotlib",
             "scipy", "pyarrow", "threadpoolctl"):
    module = importlib.import_module(name)
    versions[name] = getattr(module, "__version__", "?")
import client_app.app, server_app.app  # noqa: E401,F401  the app itself
import torch
print(f"Python {sys.version.split()[0]} at {sys.executable}")
print(", ".join(f"{k} {v}" for k, v in versions.items()))
print("CUDA:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available")
EOF
  )
}

step_tests() {
  local files=()
  # Tests that use CUDA: marked (pytest.mark.cuda) or asking torch about it.
  mapfile -t files < <(cd "$root" && grep -l -E 'mark\.cuda|torch\.cuda|device\(["'"'"']cuda' tests/test_*.py \
    | grep -v 'tests/test_gpu_kit.py' || true)
  if [ ${#files[@]} = 0 ]; then
    echo "tests: no test in tests/ uses CUDA (pytest.mark.cuda, torch.cuda, device('cuda')): nothing to run"
    return 0
  fi
  echo "tests: ${files[*]}"
  (cd "$root" && "$py" -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" "${files[@]}")
}

step_bench() {
  [ "$device" = cpu ] || "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "bench: no CUDA device")'
  (cd "$root" && "$py" bench/client_update.py --device "$device" --repeats "$repeats" --out "$OUT/client_update.json")
  if [ "$dry" = 1 ]; then  # a CPU dry run checks the kit, not bfloat16 on a CPU (a minute saved)
    echo "bench: dry run, --mixed-precision left out"
    return 0
  fi
  (cd "$root" && "$py" bench/client_update.py --device "$device" --repeats "$repeats" --mixed-precision \
     --out "$OUT/client_update_amp.json")
}

step_deploy() {
  local args=(--clients "$clients" --rounds "$rounds" --device "$device" --out "$OUT"
              --timeout "$deploy_timeout" --database "$database")
  if [ -n "$data" ]; then
    args+=(--data "$data")
  elif [ "$dry" = 1 ]; then  # exported now, small: the machine running a dry run has Fashion-MNIST
    args+=(--data-config "samples-per-client=100 test-samples-per-client=50" --run-config "local-epochs=1" --settle 0)
  else
    args+=(--data "$here/data/fashion-mnist-$clients")
  fi
  [ "$deploy_amp" = 1 ] && args+=(--mixed-precision)
  [ -n "$host_slots" ] && args+=(--host-slots "$host_slots")
  [ -n "${KIT_CERTS:-}" ] && args+=(--certs "$KIT_CERTS")
  (cd "$root" && "$py" deploy/gpu/deploy_run.py "${args[@]}")
}

if has_step install; then
  run_step install step_install
  if [ "${status[install]}" != 0 ]; then
    log "cannot go on without the install"
    exit 1
  fi
fi
if has_step tests || has_step bench || has_step deploy; then
  run_step imports step_smoke
  [ "${status[imports]}" = 0 ] || { log "cannot go on: the app does not import"; exit 1; }
fi
has_step tests && run_step tests step_tests
has_step bench && run_step bench step_bench
has_step deploy && run_step deploy step_deploy

log "summary"
step_list=""
for name in "${!status[@]}"; do step_list+="$name=${status[$name]} "; done
"$py" - "$OUT" "$started" "$dry" "$step_list" <<'EOF'
import json, sys, time
from pathlib import Path
out, started, dry, steps = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1", sys.argv[4].split()
def read(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None
summary = {"dry_run": dry, "steps": {k: int(v) for k, v in (s.split("=") for s in steps)},
           "kit_wall_seconds": time.time() - started}
for name in ("client_update", "client_update_amp"):
    bench = read(f"{name}.json")
    if bench:
        summary[name] = {k: bench.get(k) for k in ("device", "mixed_precision", "fedpac_samples_per_s",
                                                  "plain_samples_per_s", "ratio")}
deployment = read("deployment.json")
if deployment:
    keep = ("status", "clients", "rounds", "rounds_done", "device", "machine", "final_accuracy",
            "run_wall_seconds", "rounds_seconds_sum", "median_round_seconds", "setup_seconds",
            "total_wall_seconds", "qp_fallbacks", "superlink_database", "host_slots", "mixed_precision")
    summary["deployment"] = {k: deployment.get(k) for k in keep}
    if deployment.get("rounds_done") == 200 and deployment.get("status") == "completed":
        summary["deployment"]["200_rounds_under_5_minutes"] = deployment["run_wall_seconds"] < 300
(out / "kit.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
EOF
log "finished in $(( $(date +%s) - started )) s; $([ "$failed" = 0 ] && echo 'every step passed' || echo 'a step FAILED')"
exit "$failed"
