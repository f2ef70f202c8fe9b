"""Write a SuperLink connection into Flower's ``config.toml``, the same way however often it runs.

    python deploy/flwr_connection.py CONFIG NAME --address HOST:PORT --root-certificates CA

(``deploy/certs.sh connect`` calls it.) The entry ``[superlink.NAME]`` is replaced when it is
there and added when it is not; every other entry and comment of the file stays as it was, and
``[superlink] default`` is set to NAME only when the file names no default yet. The file is
checked before and after (a file that is not valid TOML is refused, not overwritten) and
replaced atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import tomllib
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")


class ConnectionConfigError(ValueError):
    """The connection cannot be written: a bad name or address, or a config file that is not TOML."""


def _table_of(line: str) -> str | None:
    """The dotted name of the table a header line opens (quotes dropped), or None."""
    match = _HEADER.match(line)
    return match.group(1).replace('"', "").replace("'", "").replace(" ", "") if match else None


def with_connection(text: str, name: str, address: str, root_certificates: str) -> str:
    """``text`` (a Flower config.toml) with ``[superlink.NAME]`` set to this address and CA."""
    if not _NAME.match(name):
        raise ConnectionConfigError(f"connection name {name!r}: use letters, digits, '-' and '_' only")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectionConfigError(f"address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:9093")
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConnectionConfigError(f"the config file is not valid TOML ({error}): fix or move it; "
                               "nothing was changed") from error
    kept: list[str] = []
    inside = False
    for line in text.splitlines():
        table = _table_of(line)
        if table is not None:
            inside = table == f"superlink.{name}" or table.startswith(f"superlink.{name}.")
        if not inside:
            kept.append(line)
    superlink = config.get("superlink", {})
    if not isinstance(superlink, dict) or "default" not in superlink:
        if isinstance(superlink, dict) and superlink:
            # a [superlink] table without a default: a key of its own, right under its header
            at = next(i for i, line in enumerate(kept) if _table_of(line) == "superlink")
            kept.insert(at + 1, f"default = {json.dumps(name)}")
        else:
            kept[:0] = ["[superlink]", f"default = {json.dumps(name)}", ""]
    while kept and not kept[-1].strip():
        kept.pop()
    entry = [f"[superlink.{name}]", f"address = {json.dumps(address)}",
             f"root-certificates = {json.dumps(root_certificates)}"]
    result = "\n".join([*kept, *([""] if kept else []), *entry]) + "\n"
    if tomllib.loads(result)["superlink"].get(name) != {"address": address, "root-certificates": root_certificates}:
        raise ConnectionConfigError(f"could not write [superlink.{name}] into this file's layout; nothing was changed")
    return result


def write_connection(config: Path, name: str, address: str, root_certificates: Path) -> str:
    """Set the connection in ``config`` (created with its folder when missing); says what it did."""
    if not root_certificates.is_file():
        raise ConnectionConfigError(f"{root_certificates}: no such file (the federation's ca.crt)")
    before = config.read_text() if config.exists() else ""
    after = with_connection(before, name, address, str(root_certificates.resolve()))
    if after == before:
        return f"{config}: [superlink.{name}] already points to {address}"
    config.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=config.parent, prefix=".config.toml.")
    with os.fdopen(handle, "w") as stream:
        stream.write(after)
    if config.exists():
        os.chmod(temporary, config.stat().st_mode & 0o777)
    os.replace(temporary, config)
    done = "replaced" if f"superlink.{name}" in _tables(before) else "added"
    return f"{config}: [superlink.{name}] -> {address} ({done})"


def _tables(text: str) -> set[str]:
    return {table for line in text.splitlines() if (table := _table_of(line)) is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="Flower's config.toml ($FLWR_HOME/config.toml)")
    parser.add_argument("name", help="the connection's name, as `flwr run . NAME` uses it")
    parser.add_argument("--address", required=True, help="the SuperLink's Control API, HOST:PORT")
    parser.add_argument("--root-certificates", required=True, type=Path, help="the federation's ca.crt")
    args = parser.parse_args(argv)
    try:
        print(write_connection(args.config, args.name, args.address, args.root_certificates))
    except ConnectionConfigError as error:
        print(f"certs.sh connect: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
