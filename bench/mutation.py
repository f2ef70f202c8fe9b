"""Mutation testing: how many small deliberate bugs in the product the quick tests catch.

mutmut (https://github.com/boxed/mutmut) puts one small change at a time into a copy of the code
(``+`` for ``-``, ``<`` for ``<=``, a constant off by one, a call's argument dropped, a string
changed, ...) and runs the tests that cover the changed function against it; a mutant that no test
fails on *survived*. The score is the share of mutants killed (a timeout counts as killed, as in
mutmut's own score). It runs over the core of the product and the code around it (``SCOPE``)
against the quick tier (``make test-fast``: the tests not marked ``e2e``).

Why mutmut: it is maintained and the most used mutation tool for Python; it runs each mutant in a
process forked from one that has already imported torch and Flower, and only the tests that
reach the mutated function (from one traced run of the suite), which is what makes thousands of
mutants affordable on a small machine. cosmic-ray starts the test command afresh for every mutant
and runs the whole selection each time.

    python bench/mutation.py [--jobs 2] [--work DIR] [--out bench/results/mutation]
                             [--only 'common/simplex_qp.py' ...] [--min-score 85]

The run happens in a fresh copy of the working tree (``--work``, kept afterwards for ``mutmut show
NAME``, and for ``mutmut run`` there, which retests only what changed). It
writes ``summary.json`` (score, counts per file) and ``survivors.md`` (every survivor's diff, with
its verdict from ``bench/mutation_triage.toml`` where one is given) under ``--out``. It is a
benchmark, not a test: a run over the whole scope takes hours on two cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRIAGE = ROOT / "bench" / "mutation_triage.toml"

# The core (the math, the config, the data and partitions, the records a run is built from) and
# the code around it that decides what a client computes and what the server accepts.
SCOPE = (
    "common/*.py",
    "client_app/train.py",
    "server_app/replies.py",
    "server_app/strategy.py",
)
# Modules whose every line is I/O or process plumbing that the e2e tier tests (each is exercised
# by the deployment tests, not by quick tests): mutating them measures the tiers' split, not the tests.
OUT_OF_SCOPE = ("common/cpu.py", "common/files.py")
# test_dependencies reads the source's imports, and every mutated module imports mutmut's
# trampoline: it tests the repository, not the product's behaviour, so it sits this out.
QUICK_TIER = ["-m", "not e2e and not cuda", "--ignore=tests/test_dependencies.py", "tests/"]

# mutmut with one operator left out: string literals. Here they are messages (log lines, errors
# whose tests match a fragment) and protocol keys that both sides read from one constant, so
# "XX" + s + "XX" survives without a bug; PIT, the reference tool for Java, has no string
# mutator by default either.
LAUNCHER = """
import sys
import libcst
from mutmut.mutation import mutators
mutators.mutation_operators[:] = [(node, op) for node, op in mutators.mutation_operators
                                  if node is not libcst.BaseString]
from mutmut.__main__ import cli
sys.argv[0] = "mutmut"
cli()
"""

# mutmut's own names for a mutant's status (`mutmut results`)
KILLED, SURVIVED, NO_TESTS, TIMEOUT, SKIPPED = "killed", "survived", "no tests", "timeout", "skipped"


def mutmut_config(only: list[str]) -> str:
    """The ``[tool.mutmut]`` table for the copy's pyproject.toml."""
    table = {
        "source_paths": ["common/", "client_app/", "server_app/"],
        "only_mutate": only,
        "do_not_mutate": list(OUT_OF_SCOPE),
        "also_copy": ["deploy/", "fedpac_data/", "experiments/", "bench/"],
        "pytest_add_cli_args_test_selection": QUICK_TIER,
        "pytest_add_cli_args": ["-p", "no:cacheprovider"],
    }
    return "\n[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())


def copy_working_tree(work: Path) -> None:
    """Tracked and untracked-but-not-ignored files, so uncommitted tests count too."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = work / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def prepare(work: Path, only: list[str]) -> None:
    """A fresh copy of the tree with mutmut configured."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    copy_working_tree(work)
    pyproject = work / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + mutmut_config(only))


def results(work: Path, mutmut: str) -> dict[str, dict[str, str]]:
    """Each mutated file's mutants and their status, as ``mutmut results --all`` names them
    (``common.config.x__coerce__mutmut_3: killed``: the module, then the mangled function)."""
    listed = subprocess.run([mutmut, "results", "--all", "true"], cwd=work, check=True, capture_output=True,
                            text=True).stdout
    by_file: dict[str, dict[str, str]] = {}
    for line in listed.splitlines():
        name, _, status = line.strip().partition(": ")
        if status:
            module = name.rsplit(".", 1)[0]
            by_file.setdefault(module.replace(".", "/") + ".py", {})[name] = status
    return dict(sorted(by_file.items()))


def score(counts: collections.Counter) -> float:
    """mutmut's score: killed or timed out, among the mutants not skipped."""
    tested = sum(counts.values()) - counts[SKIPPED]
    return 100.0 * (counts[KILLED] + counts[TIMEOUT]) / tested if tested else 0.0


def load_triage() -> dict[str, str]:
    """Verdicts on survivors: mutant name -> "equivalent: why" or "accepted: why"."""
    if not TRIAGE.is_file():
        return {}
    return {name: str(verdict) for name, verdict in tomllib.loads(TRIAGE.read_text()).get("survivors", {}).items()}


def diff_of(work: Path, name: str, mutmut: str) -> str:
    shown = subprocess.run([mutmut, "show", name], cwd=work, capture_output=True, text=True)
    return shown.stdout.strip() or shown.stderr.strip()


def write_report(work: Path, out: Path, mutmut: str, wall: float | None) -> dict:
    by_file = results(work, mutmut)
    triage = load_triage()
    totals: collections.Counter = collections.Counter()
    files = {}
    for source, statuses in by_file.items():
        counts = collections.Counter(statuses.values())
        totals.update(counts)
        files[source] = {"mutants": len(statuses), "score": round(score(counts), 2), **counts}
    survivors = sorted(name for statuses in by_file.values() for name, s in statuses.items()
                       if s in (SURVIVED, NO_TESTS, "suspicious"))
    summary = {
        "score": round(score(totals), 2),
        "mutants": sum(totals.values()),
        "counts": dict(totals),
        "survivors": len(survivors),
        "survivors_triaged": sum(name in triage for name in survivors),
        "equivalent": sum(triage.get(name, "").startswith("equivalent") for name in survivors),
        "wall_seconds": wall,
        "tests": " ".join(QUICK_TIER),
        "files": files,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# Surviving mutants ({len(survivors)} of {summary['mutants']}; score {summary['score']} %)", ""]
    for name in survivors:
        status = next(s[name] for s in by_file.values() if name in s)
        verdict = triage.get(name, "not triaged")
        lines += [f"## {name} ({status})", "", f"Verdict: {verdict}", "", "```diff",
                  diff_of(work, name, mutmut), "```", ""]
    (out / "survivors.md").write_text("\n".join(lines))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    parser.add_argument("--work", type=Path, default=ROOT / ".mutation", help="the copy the run happens in")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "mutation")
    parser.add_argument("--only", nargs="+", default=list(SCOPE), help="glob patterns of files to mutate")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the run in --work (the mutants it has not tested yet), no fresh copy")
    parser.add_argument("--report-only", action="store_true", help="summarize the last run in --work")
    parser.add_argument("--min-score", type=float, default=None, help="exit 1 below this score")
    args = parser.parse_args(argv)
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or shutil.which("mutmut")
    if mutmut is None:
        parser.error("mutmut is not installed: pip install -c requirements.lock '.[mutation]'")
    work = args.work.resolve()
    wall = None
    if not args.report_only:
        if not args.resume:
            prepare(work, args.only)
        started = time.monotonic()
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, "-c", LAUNCHER, "run", "--max-children", str(args.jobs)],
                             cwd=work, env=env)
        wall = round(time.monotonic() - started, 1)
        if run.returncode != 0:
            print(f"mutmut run ended with status {run.returncode}; the report covers what it tested", file=sys.stderr)
    summary = write_report(work, args.out, mutmut, wall)
    print(json.dumps({k: v for k, v in summary.items() if k != "files"}, indent=1))
    if args.min_score is not None and summary["score"] < args.min_score:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
