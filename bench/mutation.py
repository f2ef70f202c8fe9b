"""Mutation testing: how many small deliberate bugs in the product the quick tests catch.

mutmut (https://github.com/boxed/mutmut) puts one small change at a time into a copy of the code
(``+`` for ``-``, ``<`` for ``<=``, a constant off by one, a call's argument dropped, a condition
negated, ...) and runs the tests that reach the changed function against it; a mutant that every
one of them passes *survived*. The score is the share of mutants killed (a timeout counts as
killed, as in mutmut's own score) among those that are not equivalent
(``bench/mutation_triage.toml`` names them, each with the reason no test can tell it from the
product); a survivor whose verdict is "killed since: <test>" counts as killed in the second score
the report gives, ``score_with_tests_added_since`` (a test written for it after the run, which
fails with the mutant applied by hand). The scope is the core of the product and the code around it, in ``GROUPS``: each
group of files is tested against the quick-tier test files written for it.

Why mutmut: it is maintained and the most used mutation tool for Python; it runs each mutant in a
process forked from one that has already imported torch and Flower, and only the tests that
reach the mutated function (from one traced run of the group's tests), with ``-x``. cosmic-ray
starts the test command afresh for every mutant and runs the whole selection each time.

    python bench/mutation.py [--jobs 2] [--sample 400 [--seed 0]] [--groups config ...]
                             [--work DIR] [--out docs/mutation] [--min-score 85]
    python bench/mutation.py --resume        # go on with an interrupted run (tests refreshed)
    python bench/mutation.py --resume --retest-survivors   # after adding tests that kill them
    python bench/mutation.py --report-only   # summarize the last run again (after triage)

The scope holds about 7,400 mutants; a survivor runs all its group's tests that reach it, so
testing every one takes a day on two cores. ``--sample N`` tests N of them, each file's share in
proportion to its size, and reports the score with its 95 % interval. Each group runs in its own
copy of the working tree under ``--work`` (kept afterwards for ``mutmut show NAME`` there). The run
writes ``summary.json`` (score, counts per file) and ``survivors.md`` (every survivor's diff, with
its verdict from ``bench/mutation_triage.toml`` where one is given) under ``--out``. It is a
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRIAGE = ROOT / "bench" / "mutation_triage.toml"

# What is mutated, in groups, each with the quick-tier test files written for that code. A mutant
# is run against its group's tests only (those that reach the mutated function), so a mutant that
# only some unrelated test would catch counts as a survivor: the score is a lower bound. It is
# what makes a run affordable: a survivor in the config parser would otherwise run every test
# that starts a federation.
GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "collaboration": (
        ("common/methods/fedpac/simplex_qp.py", "common/methods/fedpac/collaboration.py", "common/statistics.py",
         "common/methods/fedpac/statistics.py", "common/methods/fedpac/centroids.py"),
        ("test_simplex_qp.py", "test_collaboration.py", "test_statistics.py", "test_aggregation.py",
         "test_bench_reference.py", "test_operator.py"),
    ),
    "concept-drift": (("common/methods/fedccfa/clustering.py", "common/drift.py"),
                      ("test_clustering.py", "test_drift.py", "test_aggregation.py")),
    "variational": (("common/methods/pfedvem/variational.py",), ("test_variational.py", "test_pfedvem.py")),
    "privacy": (("common/privacy.py", "common/site_privacy.py"), ("test_privacy.py", "test_site_privacy.py")),
    "config": (("common/config.py",), ("test_config.py", "test_config_table.py")),
    "data": (("common/data.py", "common/partition.py"),
             ("test_data.py", "test_partition.py", "test_vem_partitions.py")),
    "sites": (("common/sites.py", "common/site_state.py", "server_app/federation.py", "client_app/site_model.py"),
              ("test_sites.py", "test_operator.py", "test_site_state.py", "test_site_models.py", "test_preflight.py",
               "test_strategy.py", "test_site_privacy.py", "test_site.py")),
    "robust": (("common/robust.py",), ("test_robust.py", "test_strategy.py")),
    "new-methods": (("common/methods/fedprox/client.py", "common/methods/fedprox/server.py",
                     "common/methods/ditto/client.py", "common/methods/ditto/server.py",
                     "common/methods/fedbabu/client.py", "common/methods/fedbabu/server.py"),
                    ("test_fedprox_ditto.py", "test_fedbabu.py", "test_baselines.py", "test_learning.py",
                     "test_site_state.py", "test_strategy.py")),
    # the rest of the paper's Table 1 (issue 55), each package against its own tests and the ones
    # every method goes through
    "table1-methods": (tuple(f"common/methods/{package}/{part}.py"
                             for package in ("apfl", "fedrod", "knnper", "pfedme", "fedfomo", "pfedhn")
                             for part in ("client", "server")) + ("common/methods/pfedhn/hypernetwork.py",),
                       ("test_lg_fedavg_apfl.py", "test_fedrod.py", "test_knnper.py", "test_pfedme.py",
                        "test_fedfomo.py", "test_pfedhn.py", "test_fedprox_ditto.py", "test_baselines.py",
                        "test_learning.py", "test_reply_table.py", "test_site_state.py")),
    "client": (("common/training.py", "common/methods/fedpac/client.py", "common/methods/baselines/client.py",
                "common/methods/fedccfa/client.py", "common/methods/pfedvem/client.py",
                "common/methods/base.py", "common/methods/client.py",
                "common/model.py"),
               ("test_train.py", "test_learning.py", "test_baselines.py", "test_fedccfa.py", "test_pfedvem.py",
                "test_fedprox_ditto.py", "test_fedbabu.py", "test_site_state.py")),
    "server": (("server_app/replies.py", "server_app/strategy.py", "common/protocol.py", "common/validation.py",
                "common/methods/server.py", "common/methods/fedpac/server.py", "common/methods/fedccfa/server.py",
                "common/methods/pfedvem/server.py"),
               ("test_strategy.py", "test_reply_table.py", "test_bad_replies.py", "test_operations.py",
                "test_resume.py", "test_learning.py", "test_aggregation.py", "test_final_delivery.py",
                "test_pfedvem.py", "test_fedccfa.py", "test_fedbabu.py", "test_protocol.py")),
}
# Modules whose every line is I/O or process plumbing that the e2e tier tests: mutating them
# measures the tiers' split, not the tests.
OUT_OF_SCOPE = ("common/cpu.py", "common/files.py")
QUICK_TIER_MARKS = ["-m", "not e2e and not cuda"]

# mutmut with one operator left out: string literals. Here they are messages (log lines, errors
# whose tests match a fragment) and protocol keys that both sides read from one constant, so
# "XX" + s + "XX" survives without a bug; PIT, the reference tool for Java, has no string
# mutator by default either.
PRELUDE = """
import sys
import libcst
from mutmut.mutation import mutators
mutators.mutation_operators[:] = [(node, op) for node, op in mutators.mutation_operators
                                  if node is not libcst.BaseString]
"""
LAUNCHER = PRELUDE + """
from mutmut.__main__ import cli
sys.argv[0] = "mutmut"
cli()
"""
# The mutants alone, not tested (mutmut run generates them, then runs every test once to see
# which tests reach which function): a sample is drawn from them first.
GENERATOR = PRELUDE + """
from mutmut import __main__ as m
m.set_mutant_under_test("mutant_generation")
m.makedirs(m.Path("mutants"), exist_ok=True)
m.copy_src_dir()
m.copy_also_copy_files()
m.setup_source_paths()
m.create_mutants(1)
"""

# mutmut's own names for a mutant's status (`mutmut results`)
KILLED, SURVIVED, NO_TESTS, TIMEOUT, SKIPPED = "killed", "survived", "no tests", "timeout", "skipped"
NOT_CHECKED = "not checked"


def mutmut_config(sources: tuple[str, ...], tests: tuple[str, ...]) -> str:
    """The ``[tool.mutmut]`` table for a group's copy's pyproject.toml."""
    table = {
        # Not deploy/ (the warm executor, the SuperLink's guards): the tests import those modules
        # from the working tree's deploy/ folder by path, which mutmut's mutated copy does not
        # replace, so its trace finds no test reaching them and every mutant has "no tests".
        "source_paths": ["common/", "client_app/", "server_app/"],
        "only_mutate": list(sources),
        "do_not_mutate": list(OUT_OF_SCOPE),
        "also_copy": ["deploy/", "fedpac_data/", "experiments/", "bench/"],
        "pytest_add_cli_args_test_selection": [*QUICK_TIER_MARKS, *(f"tests/{name}" for name in tests)],
        "pytest_add_cli_args": ["-p", "no:cacheprovider"],
        # Forked straight from the process that ran the suite, a mutant's tests hang in torch's
        # thread pool (its threads do not survive a fork) and count as "timeout", i.e. killed.
        "process_isolation": "forkserver",
        # A mutant's run starts a pytest session (seconds on a loaded machine) before its first
        # test: mutmut's 1 s allowance made most of them "timeout", i.e. killed, on two busy cores.
        "timeout_constant": 30.0,
        # mutmut's default 15 x (the tests' time + the constant) makes each mutant that hangs a
        # test (a wait that never ends) cost 8 minutes or more; 4 x still leaves a loaded machine
        # room, and such a mutant is a timeout, i.e. killed, either way.
        "timeout_multiplier": 4.0,
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


def prepare(work: Path, group: str) -> None:
    """A fresh copy of the tree with mutmut configured for ``group``, its mutants generated."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    copy_working_tree(work)
    configure(work, group)
    subprocess.run([sys.executable, "-c", GENERATOR], cwd=work, check=True, stdout=subprocess.DEVNULL)


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


def stratified_sample(by_file: dict[str, list[str]], size: int, seed: int) -> list[str]:
    """``size`` mutants, each file's share in proportion to its mutants (at least one from a file
    that has any), drawn with ``seed``: the score of a sample estimates the whole scope's."""
    total = sum(len(names) for names in by_file.values())
    if size >= total:
        return sorted(name for names in by_file.values() for name in names)
    rng = random.Random(seed)
    chosen: list[str] = []
    for _, names in sorted(by_file.items()):
        share = max(1, round(size * len(names) / total)) if names else 0
        chosen += rng.sample(sorted(names), min(share, len(names)))
    return sorted(chosen)


def tested(counts: collections.Counter) -> int:
    return sum(counts.values()) - counts[SKIPPED] - counts[NOT_CHECKED]


def score(counts: collections.Counter) -> float:
    """mutmut's score: killed or timed out, among the mutants tested and not skipped."""
    return 100.0 * (counts[KILLED] + counts[TIMEOUT]) / tested(counts) if tested(counts) else 0.0


def wilson_interval(killed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % interval of a score estimated from ``n`` sampled mutants (Wilson's, which stays
    inside [0, 100] near the ends)."""
    if n == 0:
        return 0.0, 100.0
    p = killed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return round(100 * (centre - half), 1), round(100 * (centre + half), 1)


def load_triage() -> dict[str, str]:
    """Verdicts on survivors: mutant name -> "equivalent: why" or "accepted: why"."""
    if not TRIAGE.is_file():
        return {}
    return {name: str(verdict) for name, verdict in tomllib.loads(TRIAGE.read_text()).get("survivors", {}).items()}


def diff_of(work: Path, name: str, mutmut: str) -> str:
    shown = subprocess.run([mutmut, "show", name], cwd=work, capture_output=True, text=True)
    return shown.stdout.strip() or shown.stderr.strip()


def write_report(works: dict[str, Path], out: Path, mutmut: str, wall: float | None) -> dict[str, Any]:
    triage = load_triage()
    totals: collections.Counter = collections.Counter()
    files, survivors = {}, []
    for group, work in works.items():
        for source, statuses in results(work, mutmut).items():
            counts = collections.Counter(statuses.values())
            totals.update(counts)
            files[source] = {"group": group, "mutants": len(statuses), "tested": tested(counts),
                             "score": round(score(counts), 2), **counts}
            survivors += [(name, status, group) for name, status in sorted(statuses.items())
                          if status in (SURVIVED, NO_TESTS, "suspicious")]
    killed = totals[KILLED] + totals[TIMEOUT]
    sampled = totals[NOT_CHECKED] > 0
    # The mutation score leaves out the mutants no test could kill (equivalent: the program's
    # behaviour is unchanged); mutmut's own score counts them as survivors.
    equivalent = sum(triage.get(name, "").startswith("equivalent") for name, _, _ in survivors)
    # survivors that a test written after the run kills (its verdict names the test): the score
    # with them counts them as killed, until a run with those tests confirms it
    killed_since = sum(triage.get(name, "").startswith("killed since") for name, _, _ in survivors)
    scored = tested(totals) - equivalent
    summary: dict[str, Any] = {
        "score": round(100.0 * killed / scored, 2) if scored else 0.0,
        "interval_95": wilson_interval(killed, scored) if sampled else None,
        "score_with_tests_added_since": round(100.0 * (killed + killed_since) / scored, 2) if scored else 0.0,
        "killed_since": killed_since,
        "mutmut_score": round(score(totals), 2),
        "mutants": sum(totals.values()),
        "tested": tested(totals),
        "counts": dict(totals),
        "survivors": len(survivors),
        "survivors_triaged": sum(name in triage for name, _, _ in survivors),
        "equivalent": equivalent,
        "wall_seconds": wall,
        "tests": {group: [*QUICK_TIER_MARKS, *tests] for group, (_, tests) in GROUPS.items() if group in works},
        "files": dict(sorted(files.items())),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    interval = f", 95 % interval {summary['interval_95'][0]}-{summary['interval_95'][1]} %" if sampled else ""
    lines = [f"# Surviving mutants ({len(survivors)} of {summary['tested']} tested, {equivalent} of them "
             f"equivalent; score {summary['score']} %{interval}; {killed_since} killed since by tests written "
             f"for them: {summary['score_with_tests_added_since']} % with those)", ""]
    for name, status, group in survivors:
        lines += [f"## {name} ({status})", "", f"Verdict: {triage.get(name, 'not triaged')}", "", "```diff",
                  diff_of(works[group], name, mutmut), "```", ""]
    (out / "survivors.md").write_text("\n".join(lines))
    return summary


def configure(work: Path, group: str) -> None:
    """The copy's pyproject.toml: the working tree's, with this script's settings for ``group``."""
    (work / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + mutmut_config(*GROUPS[group]))


def refresh(work: Path, group: str) -> None:
    """The working tree's tests and this script's mutmut settings into a copy made before: a
    resumed run tests against the tests as they are now (mutmut traces the new ones first). The
    product code stays the copy's: tests that import a module the copy lacks cannot be collected,
    and a run on changed code starts afresh."""
    for source in (ROOT / "tests").glob("*.py"):
        shutil.copy2(source, work / "tests" / source.name)
    configure(work, group)


def run_group(work: Path, group: str, mutmut: str, jobs: int, retest: bool = False) -> None:
    """Test the mutants of the group's sample that are not tested yet (with ``retest``, also the
    survivors again: after tests were added to kill them)."""
    sample_file = work / "sample.txt"
    statuses = {name: status for by in results(work, mutmut).values() for name, status in by.items()}
    # a timeout again too: its verdict depends on the machine's load and the timeout settings
    again = (NOT_CHECKED, TIMEOUT, SURVIVED, NO_TESTS, "suspicious") if retest else (NOT_CHECKED, TIMEOUT)
    pending = [name for name in sample_file.read_text().split() if statuses.get(name) in again]
    if not pending:
        return
    print(f"{group}: {len(pending)} mutants to test", flush=True)
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", LAUNCHER, "run", "--max-children", str(jobs), *pending],
                         cwd=work, env=env, stdout=subprocess.DEVNULL)
    if run.returncode != 0:
        print(f"{group}: mutmut run ended with status {run.returncode}; the report covers what it tested",
              file=sys.stderr)


def draw_samples(works: dict[str, Path], mutmut: str, size: int | None, seed: int) -> None:
    """Each group's share of a ``size``-mutant sample of the whole scope (every mutant without a
    size), written to its copy's ``sample.txt`` for the run and any resumed run."""
    by_group = {group: {source: list(statuses) for source, statuses in results(work, mutmut).items()}
                for group, work in works.items()}
    scope = sum(len(names) for by_file in by_group.values() for names in by_file.values())
    for group, by_file in by_group.items():
        in_group = sum(map(len, by_file.values()))
        share = in_group if size is None else max(1, round(size * in_group / scope))
        (works[group] / "sample.txt").write_text("\n".join(stratified_sample(by_file, share, seed)) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    parser.add_argument("--work", type=Path, default=ROOT / ".mutation", help="the copies the run happens in")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "mutation",
                        help="summary.json and survivors.md (each survivor with its verdict)")
    parser.add_argument("--groups", nargs="+", choices=sorted(GROUPS), default=list(GROUPS),
                        help="which groups of files to mutate")
    parser.add_argument("--sample", type=int, default=None,
                        help="test this many mutants, drawn in proportion from every file (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the run in --work (the sampled mutants not tested yet), no fresh copy")
    parser.add_argument("--retest-survivors", action="store_true",
                        help="with --resume: test the survivors again, against the tests as they are now")
    parser.add_argument("--report-only", action="store_true", help="summarize the last run in --work")
    parser.add_argument("--min-score", type=float, default=None, help="exit 1 below this score")
    args = parser.parse_args(argv)
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or shutil.which("mutmut")
    if mutmut is None:
        parser.error("mutmut is not installed: pip install -c requirements.lock '.[test]'")
    root = args.work.resolve()
    works = {group: root / group for group in args.groups}
    wall = None
    if not args.report_only:
        started = time.monotonic()
        if not args.resume:
            for group, work in works.items():
                prepare(work, group)
            draw_samples(works, mutmut, args.sample, args.seed)
        for group, work in works.items():
            if args.resume:
                refresh(work, group)
            run_group(work, group, mutmut, args.jobs, retest=args.retest_survivors)
        wall = round(time.monotonic() - started, 1)
    summary = write_report(works, args.out, mutmut, wall)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("files", "tests")}, indent=1))
    if args.min_score is not None and summary["score"] < args.min_score:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
