#!/usr/bin/env bash
# Build what the GPU kit carries to the GPU machine (Python 3.12, torch + torchvision and the
# packages of its image preinstalled, no flwr, no network, 64 MiB for all that travels):
#   deploy/gpu/make-wheelhouse.sh [DIR] [--data DIR] [--clients N] [--no-data] [--python PY]
#                                 [--budget-mib M] [--list]
#     DIR            the wheelhouse (default deploy/gpu/wheels): cp312 manylinux x86_64 wheels of
#                    deploy/gpu/requirements.txt, no dependencies resolved (that file is the
#                    closure, minus what the image has and what the kit never imports), versions
#                    pinned to PY's (`pip freeze`), plus constraints.txt
#     --data DIR     client data folders (default deploy/gpu/data): the Fashion-MNIST paper
#                    protocol's N partitions (deploy/gpu/kit_data.py), DIR/fashion-mnist-N
#     --clients N    clients of those partitions (default 20)
#     --no-data      wheels only
#     --python PY    the interpreter whose pip downloads and whose packages set the versions
#                    (default: the project's .venv/bin/python, else python3)
#     --budget-mib M fail when wheels + data + the working tree exceed M MiB (default 64)
#     --list         print the distributions the wheelhouse would hold, and exit
# Both folders are git-ignored; name them in the device tool's carry: deploy/gpu/wheels,
# deploy/gpu/data. Then deploy/gpu/run-kit.sh there (see its header).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
wheels="$here/wheels" data="$here/data" clients=20 with_data=1 python="" budget=64 list=0
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --no-data) with_data=0; shift ;;
    --python) python="$2"; shift 2 ;;
    --budget-mib) budget="$2"; shift 2 ;;
    --list) list=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    -*) echo "make-wheelhouse.sh: unknown option $1" >&2; exit 2 ;;
    *) wheels="$1"; shift ;;
  esac
done
[[ "$clients" =~ ^[1-9][0-9]*$ ]] || { echo "make-wheelhouse.sh: --clients must be a positive integer" >&2; exit 2; }
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
requirements="$here/requirements.txt"
names=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$requirements" | grep -v '^$')

if [ "$list" = 1 ]; then
  echo "$names"
  exit 0
fi

step() { printf '\n== make-wheelhouse: %s\n' "$*"; }

step "wheels into $wheels ($(echo "$names" | wc -l) distributions, cp312 manylinux x86_64)"
mkdir -p "$wheels"
rm -f "$wheels"/*.whl "$wheels/constraints.txt"
# The versions tested here: the build interpreter's packages (editable project left out).
"$python" -m pip freeze --exclude-editable 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==' > "$wheels/constraints.txt" || true
echo "pinned to $(wc -l < "$wheels/constraints.txt") versions of $("$python" -c 'import sys; print(sys.executable)')"
platforms=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# shellcheck disable=SC2086  # one requirement per word
if ! "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" \
    -c "$wheels/constraints.txt" -d "$wheels" $names \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); then
  cat >&2 <<'EOF'
make-wheelhouse.sh: pip download failed. The wheels must be cp312 builds from a package
registry: this machine's installed packages are builds for its own Python and cannot stand in
for the compiled ones (grpcio, cryptography, pydantic-core, cvxpy, ...). Check the network or
the pip configuration (pip config list) and run again.
EOF
  exit 1
fi
# One wheel per distribution, none of what the requirements file leaves out.
"$python" - "$wheels" $names <<'EOF'
import re, sys
from pathlib import Path
folder, wanted = Path(sys.argv[1]), {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[2:]}
have = {}
for wheel in folder.glob("*.whl"):
    have.setdefault(re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower(), []).append(wheel.name)
twice = {k: v for k, v in have.items() if len(v) > 1}
missing, extra = wanted - set(have), set(have) - wanted
if twice or missing or extra:
    sys.exit(f"wheelhouse mismatch: twice {twice}, missing {sorted(missing)}, unexpected {sorted(extra)}")
print(f"{len(have)} wheels, one per distribution")
EOF

if [ "$with_data" = 1 ]; then
  target="$data/fashion-mnist-$clients"
  step "client data: Fashion-MNIST paper protocol, $clients clients, into $target"
  rm -rf "$target"
  "$python" "$here/kit_data.py" --clients "$clients" --out "$target"
fi

step "size against the ${budget} MiB that may travel"
bytes_of() { if [ -e "$1" ]; then du -sb "$1" | cut -f1; else echo 0; fi; }
wheel_bytes=$(bytes_of "$wheels")
data_bytes=$(bytes_of "$data")  # what is there, built now or before
# The working tree travels too: tracked files and untracked ones git does not ignore.
tree_bytes=$(cd "$root" && { git ls-files -z --cached; git ls-files -z --others --exclude-standard; } \
  | sort -zu | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((wheel_bytes + data_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
printf '  wheels        %s (%s)\n' "$(mib "$wheel_bytes")" "$wheels"
printf '  client data   %s (%s)\n' "$(mib "$data_bytes")" "$data"
printf '  working tree  %s (git ls-files, tracked + untracked not ignored)\n' "$(mib "$tree_bytes")"
printf '  total         %s of %s MiB\n' "$(mib "$total")" "$budget"
echo "largest wheels:"
ls -S "$wheels"/*.whl | head -5 | while read -r w; do printf '  %s  %s\n' "$(mib "$(stat -c %s "$w")")" "$(basename "$w")"; done
if [ "$total" -gt $((budget * 1048576)) ]; then
  echo "make-wheelhouse.sh: OVER BUDGET: $(mib "$total") > $budget MiB" >&2
  # What a device call carries is the working tree as it is: say which folders weigh most, so
  # that the ones the kit never reads (published runs, grid archives) can leave for the call.
  echo "largest folders of the working tree (move those the kit does not need out of the checkout for the call):" >&2
  (cd "$root" && { git ls-files -z --cached; git ls-files -z --others --exclude-standard; } | sort -zu \
    | xargs -0 -r stat -c '%s %n' 2>/dev/null \
    | awk '{n = split($2, p, "/"); d = (n > 2) ? p[1] "/" p[2] : p[1]; s[d] += $1} END {for (d in s) print s[d], d}' \
    | sort -rn | head -5 | while read -r bytes folder; do printf '  %s  %s\n' "$(mib "$bytes")" "$folder"; done) >&2
  exit 1
fi
echo "within budget. Carry: deploy/gpu/wheels deploy/gpu/data (paths relative to the repository root)"
