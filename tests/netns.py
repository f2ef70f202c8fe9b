"""Several hosts on one machine: one network namespace per host on a virtual bridge, each host
reachable from the others by its name (``/etc/netns/<ns>/hosts``), so traffic between them
crosses a real (virtual) network. Root only (see ``tests.prerequisites.require_root_networking``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def _ip(*args: str, ns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True)


def _ip(*args: str, ns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True)


class VirtualNetwork:
    """One namespace per host on a bridge, with /etc/netns/<ns>/hosts naming every host."""

    def __init__(self, tag: str, hosts: tuple[str, ...], subnet: str) -> None:
        self.bridge = f"fpbr{tag}"
        self.namespaces = {host: f"fp{tag}-{host}" for host in hosts}
        self.addresses = {host: f"{subnet}.{10 + i}" for i, host in enumerate(hosts)}
        self.hosts_file = "".join(f"{address} {host}\n" for host, address in self.addresses.items())
        self.forward_rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, (host, ns) in enumerate(self.namespaces.items()):
            _ip("netns", "add", ns)
            outside, inside = f"fp{tag}h{i}", f"fp{tag}n{i}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("addr", "add", f"{self.addresses[host]}/24", "dev", inside, ns=ns)
            _ip("link", "set", inside, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(f"127.0.0.1 localhost\n{self.hosts_file}")
        # a Docker engine that ran on this machine leaves FORWARD's policy at DROP, which also
        # drops bridged traffic between the namespaces
        if shutil.which("iptables"):
            subprocess.run(["iptables", "-I", *self.forward_rule], check=True, capture_output=True)

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host]]

    def close(self) -> None:
        if shutil.which("iptables"):
            subprocess.run(["iptables", "-D", *self.forward_rule], capture_output=True)
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
