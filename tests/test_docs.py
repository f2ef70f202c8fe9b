"""The user documentation: a short README, links that resolve, every run-config key documented,
and no development-process talk (machines, sessions, issue numbers, commit hashes)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "CONFIGURATION.md"
README_MAX_LINES = 250


def user_docs() -> list[Path]:
    """Every page a user reads: the README, docs/*.md, and the READMEs of deploy/ and experiments/."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    pages += [page for page in (ROOT / "deploy" / "README.md", ROOT / "experiments" / "README.md") if page.is_file()]
    return pages


# ---------------------------------------------------------------------------------------------
# helpers (each one is also tested on a bad example below, so that its assertion can fail)

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def without_code(text: str) -> str:
    """The text with fenced code blocks removed and inline code spans blanked (links stay)."""
    return INLINE_CODE.sub("`code`", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)                 # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)        # links keep their text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of ``page`` whose file, or #anchor in a Markdown file, does not exist."""
    problems = []
    for target in LINK.findall(without_code(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{page.relative_to(root)}: {target} (no such file)")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return problems


DEVELOPMENT_TALK = [
    re.compile(r"development machines?", re.I),
    re.compile(r"\blent\b", re.I),
    re.compile(r"\bissues? \d+", re.I),
    re.compile(r"\b(?:this|an earlier|a later|the last|the next) sessions?\b", re.I),
    re.compile(r"unreachable here", re.I),
    re.compile(r"\bCI machines?", re.I),
    re.compile(r"machines? this project", re.I),
    # a commit hash: 7-40 hex digits (with a digit and a letter) in backticks or after "commit"
    re.compile(r"`(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}`"),
    re.compile(r"\bcommits?\s+(?:at\s+)?`?(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", re.I),
    # ... or standing alone, "(8ec57ba)", "at d5a83be" (not a path's or a file name's part: a URL's
    # revision, a cell folder's hash)
    re.compile(r"(?<![/\w.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/.-])"),
]


def development_talk(text: str) -> list[str]:
    """Each line of ``text`` that speaks of how the product was built rather than of the product."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in DEVELOPMENT_TALK:
            match = pattern.search(line)
            if match:
                found.append(f"line {number}: {match.group(0)!r}")
    return found


def config_keys() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return list(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])


def undocumented(keys: list[str], text: str) -> list[str]:
    """The keys without a table row of their own (a row starting with | `key` |)."""
    return [key for key in keys if not re.search(rf"^\| `{re.escape(key)}` \|", text, re.M)]


# ---------------------------------------------------------------------------------------------
# the documentation


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}: move detail to docs/"


@pytest.mark.parametrize("page", user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_every_run_config_key_is_documented() -> None:
    keys = config_keys()
    assert len(keys) > 50
    assert undocumented(keys, CONFIGURATION.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("page", user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_talk(page: Path) -> None:
    assert development_talk(page.read_text(encoding="utf-8")) == []


# ---------------------------------------------------------------------------------------------
# the checks themselves fail on bad documentation


def test_link_check_finds_missing_files_and_headings(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Status, logs: stop\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#status-logs-stop) [ok](#page) [web](https://example.org/x)\n"
        "```\n[in code](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nothing) [bad local](#nope) ![img](pic.png)\n",
        encoding="utf-8",
    )
    assert broken_links(page, tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nothing (no such heading)",
        "page.md: #nope (no such heading)",
        "page.md: pic.png (no such file)",
    ]


def test_slugs_follow_github() -> None:
    assert slug("Deployment: a round against the simulation's, and the cost of a message") == (
        "deployment-a-round-against-the-simulations-and-the-cost-of-a-message")
    assert slug("Soak: 100 clients, 10 % failing calls") == "soak-100-clients-10--failing-calls"
    assert slug("The `strategy` key") == "the-strategy-key"


def test_development_talk_is_found() -> None:
    bad = [
        "measured on the development machine",
        "the one GPU lent to this project",
        "issue 15's goal",
        "in this session",
        "Docker Hub is unreachable here",
        "commit `919ff52`",
        "the code frozen at `941bb0a`",
        "before (commit 8ec57ba)",
        "the code before (d5a83be) and after",
        "run-kit.sh at 8ec57ba, then",
        "on the CI machine",
    ]
    for line in bad:
        assert development_talk(line), line
    good = [
        "measured on a 2-core x86-64 CPU, 24 GiB, no GPU",
        "one H100",
        "an excellent, silent, equivalent result",
        "`fedpac-predict`, `final_state.npz`, `1000000`",
        "see the issue tracker",
        "[code](https://github.com/owner/repo/tree/17b5b11), cells/fedavg-20c-seed0-56db28af5f/",
        "weights within 2e-3, 1e300, 0.0005, 24,421 samples/s, SHA256:Dj1abc",
    ]
    for line in good:
        assert development_talk(line) == [], line


def test_undocumented_keys_are_found() -> None:
    text = "| `strategy` | `fedpac` | – | the method |\n| `seed`, `device` | 0 | – | both |\nmentions `batch-size`\n"
    assert undocumented(["strategy", "seed", "device", "batch-size"], text) == ["seed", "device", "batch-size"]
