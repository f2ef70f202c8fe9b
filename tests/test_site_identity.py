"""Attacks on a real deployment's trust: a localhost TLS + SuperNode-authentication federation
started with deploy/superlink.sh and deploy/supernode.sh, driven by `flwr run`.

* Enrolled rogue nodes (their keys registered, so the SuperLink lets them in) claim site 0's
  partition, one at the pre-flight and one in the middle of the run: they receive nothing, save
  nothing, and the run ends with the same final model as without them, bit for bit.
* One of them, over its own signed connection, pushes an instruction to site 0's node in the
  server's name mid-run: the SuperLink refuses and logs it, and site 0 never receives it.
* A revoked node (`flwr supernode unregister`) is refused from its next request on; the run
  goes on with the others.
* The Control API, which runs code at every site, listens on this host only unless told not to.
"""

from __future__ import annotations

import csv
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.app import ConfigRecord, Message, MessageType, Metadata, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.client.grpc_rere_client.node_auth_client_interceptor import NodeAuthClientInterceptor
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.serde import message_to_proto
from flwr.proto.fleet_pb2 import PushMessagesRequest  # pylint: disable=E0611
from flwr.proto.fleet_pb2_grpc import FleetStub  # pylint: disable=E0611
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.supercore.error import ApiErrorCode, FlowerError
from flwr.supercore.grpc import create_channel
from flwr.supercore.inflatable.inflatable_object import get_object_tree
from flwr.supercore.interceptors import RuntimeVersionClientInterceptor

from tests.deployment import (
    BIN,
    FEDERATION,
    ROOT,
    SMALL,
    Federation,
    Workstation,
    create_certificates,
    descends_from,
    rounds_of,
    run_dir,
    stop_groups,
    wait_for_rounds,
)
from tests.prerequisites import require_linux

pytestmark = pytest.mark.e2e

SITES = (0, 1)
HOSTILE_SITE = Path(__file__).resolve().parent / "hostile_site"
CERTS = ROOT / "deploy" / "certs.sh"
ROGUES = (2, 3)  # enrolled keys, registered as supernode-2 and supernode-3: no partition of a 2-site run


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    work = tmp_path_factory.mktemp("federation")
    fed = Federation(work, create_certificates(work / "certs", len(SITES) + len(ROGUES)), num_nodes=len(SITES))
    fed.node_ids = fed.register(*SITES, *ROGUES)
    # site 1's machine is compromised (tests/hostile_site): honest until its padding flag is set
    fed.padding_flag = work / "pad-replies"
    for pid in SITES:
        fed.start_node(pid, environment={"PYTHONPATH": str(HOSTILE_SITE), "FEDPAC_TEST_PAD_REPLIES":
                                         str(fed.padding_flag)} if pid == 1 else None)
    fed.wait_online(len(SITES))
    yield fed
    fed.close()


def _run(federation: Federation, out: Path, rounds: int, extra: str = "min-available-clients=2") -> str:
    return federation.submit(f"{SMALL} num-server-rounds={rounds} output-dir='{out}' {extra}")


def _final_state(out: Path) -> dict[str, np.ndarray]:
    with np.load(run_dir(out) / "final_state.npz") as saved:
        return {key: saved[key] for key in saved.files}


def _push_instruction(federation: Federation, key: int, node_id: int, run_id: int,
                      victim: int) -> tuple[str, FlowerError | None]:
    """Enrolled node ``node_id`` (key ``key``) pushes an evaluate instruction to node ``victim`` in
    the SuperLink's name, over a channel made as Flower's SuperNode makes its own (TLS, every
    request signed with the node's registered key by Flower's NodeAuthClientInterceptor): the
    forged message's id and the SuperLink's refusal (None if it took the push)."""
    private_key = load_ssh_private_key((federation.certs / "keys" / f"supernode-{key}").read_bytes(), None)
    assert isinstance(private_key, ec.EllipticCurvePrivateKey)  # as Flower's SuperNode loads it
    channel = create_channel(federation.fleet_address, insecure=False,
                             root_certificates=(federation.certs / "ca.crt").read_bytes(),
                             interceptors=[RuntimeVersionClientInterceptor(component_name="SuperNode"),
                                           NodeAuthClientInterceptor(private_key, private_key.public_key())])
    metadata = Metadata(run_id, "", SUPERLINK_NODE_ID, victim, "", "", time.time(), 600, MessageType.EVALUATE)
    forged = Message(RecordDict({"config": ConfigRecord({"forged": True})}), metadata=metadata)  # type: ignore[call-overload]
    forged.metadata.__dict__["_message_id"] = forged.object_id
    request = PushMessagesRequest(node=Node(node_id=node_id),
                                  messages_list=[message_to_proto(remove_content_from_message(forged))],
                                  message_object_trees=[get_object_tree(forged)])
    try:
        FleetStub(channel).PushMessages(request, timeout=30)
    except Exception as refused:  # noqa: BLE001  # a grpc.RpcError, its details Flower's error
        return forged.metadata.message_id, FlowerError.from_json(refused.details())  # type: ignore[attr-defined]
    finally:
        channel.close()
    return forged.metadata.message_id, None


def _trained_partitions(out: Path) -> dict[int, set[str]]:
    rows = csv.DictReader((run_dir(out) / "clients.csv").open())
    trained: dict[int, set[str]] = {}
    for row in rows:
        trained.setdefault(int(row["round"]), set()).add(row["partition_id"])
    return trained


def test_enrolled_rogue_nodes_claiming_site_0_get_nothing_and_change_nothing(federation, tmp_path):
    rounds = 8
    honest = tmp_path / "honest"
    run_id = _run(federation, honest, rounds)
    assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]

    # (a) a rogue online at the pre-flight, claiming partition 0 with its own enrolled key
    federation.start_node(0, key=ROGUES[0], label="rogue-pre", model_dir=tmp_path / "rogue-pre", restarts=0)
    federation.wait_online(len(SITES) + 1)
    attacked = tmp_path / "attacked"
    run_id = _run(federation, attacked, rounds)
    # (b) a second one joining in the middle of the run, claiming partition 0 too
    wait_for_rounds(attacked, 2)
    federation.start_node(0, key=ROGUES[1], label="rogue-mid", model_dir=tmp_path / "rogue-mid", restarts=0)
    # (c) the first, enrolled, sends site 0's node an instruction of its own in the server's name
    victim, attacker = federation.node_ids[0], federation.node_ids[ROGUES[0]]
    forged, refusal = _push_instruction(federation, ROGUES[0], attacker, int(run_id), victim)
    assert refusal is not None and refusal.code == ApiErrorCode.NO_PERMISSIONS, refusal
    assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]
    assert (f"Refused PushMessages from node {attacker}: it pushed an instruction ('evaluate', from node "
            f"{SUPERLINK_NODE_ID} to node {victim})") in federation.read_log("superlink")
    assert forged not in federation.read_log("supernode-0")
    log = federation.log(run_id)

    # both were refused by identity, named in the ServerApp's log
    for rogue in ROGUES:
        assert f"Refused node {federation.node_ids[rogue]}: its identity (name 'supernode-{rogue}'" in log, log[-3000:]
    assert rounds_of(attacked)[-1]["round"] == str(rounds)
    # the rogue that joined mid-run was there while rounds were still to come
    refused_mid = log.index(f"Refused node {federation.node_ids[ROGUES[1]]}")
    assert f"Round {rounds}: mean personalized accuracy" in log[refused_mid:]
    # the honest sites trained and were evaluated every round
    assert all(int(r["num_trained"]) == 2 and int(r["num_evaluated"]) == 2 for r in rounds_of(attacked))
    assert _trained_partitions(attacked) == {r: {"0", "1"} for r in range(1, rounds + 1)}
    # the rogues received nothing of any partition and saved nothing: before anyone answered
    # the pre-flight, the federation's size was unknown, so the first could only be refused
    # after its answer to the query (a round number, nothing else); the second was refused by
    # its identity alone and received no message at all
    assert "Receiving: query message" in federation.read_log("supernode-rogue-pre")
    assert not any(f"Receiving: {kind} message" in federation.read_log("supernode-rogue-pre")
                   for kind in ("train", "evaluate"))
    assert "[RUN " not in federation.read_log("supernode-rogue-mid")
    for label in ("rogue-pre", "rogue-mid"):
        assert not any((tmp_path / label).iterdir())
    # the same final model, bit for bit, as the run without them
    with_rogues, without = _final_state(attacked), _final_state(honest)
    assert with_rogues.keys() == without.keys()
    for key, value in without.items():
        np.testing.assert_array_equal(with_rogues[key], value, err_msg=key)
    for label in ("rogue-pre", "rogue-mid"):
        federation.supernodes.pop(label).terminate()


class PeakMemory:
    """The largest peak resident memory (VmHWM) of any ServerApp process (``flwr-serverapp``)
    under process ``ancestor`` (a SuperLink) seen while the block runs, read from /proc twice a
    second. Only that SuperLink's: a test on the other pytest worker may run ServerApps too."""

    def __init__(self, ancestor: int) -> None:
        self.ancestor = ancestor
        self.peak_kib = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            for proc in Path("/proc").iterdir():
                try:
                    if (proc.name.isdigit() and b"flwr-serverapp" in (proc / "cmdline").read_bytes()
                            and descends_from(int(proc.name), self.ancestor)):
                        status = (proc / "status").read_text()
                        self.peak_kib = max(self.peak_kib, int(status.split("VmHWM:")[1].split()[0]))
                except (OSError, IndexError, ValueError):  # gone meanwhile, or a kernel thread
                    continue


def test_an_oversize_reply_is_refused_where_it_enters_and_never_reaches_the_serverapp(federation, tmp_path):
    """Site 1, enrolled and bound to its partition, answers a training message with a reply 1 GiB
    larger than an honest one: the SuperLink refuses it while it is pushed (its log names the
    node), the run completes with site 0's reply, and the ServerApp's peak memory stays that of
    an honest run (it used to pull and inflate every byte before its own size check).

    A ServerApp that took the reply would hold its bytes at least twice (the pulled chunks and the
    inflated array): a peak 2 GiB over the honest one. The bound is half the padding because the
    peak of the same honest job varies by up to about 175 MB from run to run on a busy host (its
    thread pools and allocator arenas), which a 256 MiB padding and a 64 MiB bound did not clear."""
    padding = 2**30
    peaks = {}
    for hostile in (False, True):
        if hostile:
            federation.padding_flag.write_text(str(padding))
        out = tmp_path / ("hostile" if hostile else "honest")
        try:
            with PeakMemory(federation.superlink.pid) as memory:
                # the refused reply never comes: the round waits round-timeout for it
                run_id = _run(federation, out, 1, "min-available-clients=2 round-timeout=40")
                assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]
        finally:
            federation.padding_flag.unlink(missing_ok=True)
        peaks[hostile] = memory.peak_kib * 1024
    assert f"Refused PushObject from node {federation.node_ids[1]}" in federation.read_log("superlink")
    assert int(rounds_of(out)[0]["num_trained"]) == 1  # site 0's reply; site 1's never arrived
    assert 0 < peaks[True] < peaks[False] + padding // 2, peaks


def test_a_revoked_node_is_refused_from_its_next_request_and_the_run_goes_on(federation, tmp_path):
    out = tmp_path / "out"
    run_id = _run(federation, out, 6, "min-available-clients=1 round-timeout=30")  # the revoked node's round waits this
    wait_for_rounds(out, 2)
    federation.flwr("supernode", "unregister", str(federation.node_ids[1]), FEDERATION)
    assert federation.wait(run_id) == "finished:completed", federation.log(run_id)[-3000:]
    rows = rounds_of(out)
    assert int(rows[-1]["num_trained"]) == 1 and int(rows[-1]["num_evaluated"]) == 1
    assert _trained_partitions(out)[6] == {"0"}
    status = {node["node-id"]: node["status"] for node in federation.nodes()}
    assert status[str(federation.node_ids[1])] == "unregistered"
    # the node itself was turned away: Flower's SuperNode stops itself when its key is refused,
    # and the site's script says what that means instead of restarting it
    assert federation.supernodes["1"].wait(timeout=120) == 0
    assert "no longer accepts this node's key" in federation.read_log("supernode-1")
    # The operator re-runs `certs.sh register` whenever a site sends its key: the keys the
    # SuperLink knows are skipped (the revoked one stays revoked), the new one is registered.
    keys = federation.certs / "keys"
    subprocess.run(["bash", str(CERTS), "site-key", "--out", str(keys), "--name", "supernode-9"], check=True,
                   capture_output=True)
    again = subprocess.run(["bash", str(CERTS), "register", "--keys", str(keys), FEDERATION], capture_output=True,
                           text=True, timeout=300, env={**federation.env, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert again.returncode == 0, again.stdout + again.stderr
    assert "registered supernode-9.pub" in again.stdout
    assert all(f"supernode-{pid}.pub: already known" in again.stdout for pid in (*SITES, *ROGUES)), again.stdout
    after = {node["node-id"]: node["status"] for node in federation.nodes()}
    assert after[str(federation.node_ids[1])] == "unregistered"
    assert [after[node] for node in after.keys() - status.keys()] == ["registered"], (status, after)
    # A key a site sent is registered under the operator's name, never its file's, and a name
    # another key holds is refused: a rogue's key sent as supernode-0.pub is not registered.
    # supernode-1's key was revoked: its name is free for that site's new key.
    sent = tmp_path / "sent"
    for name in ("supernode-0", "supernode-1"):
        subprocess.run(["bash", str(CERTS), "site-key", "--out", str(sent / name), "--name", name], check=True,
                       capture_output=True)
    register = [(str(sent / "supernode-0" / "supernode-0.pub"), FEDERATION),
                ("--name", "supernode-0", str(sent / "supernode-0" / "supernode-0.pub"), FEDERATION),
                ("--name", "supernode-1", str(sent / "supernode-1" / "supernode-1.pub"), FEDERATION)]
    unnamed, taken, replaced = (subprocess.run(["bash", str(CERTS), "register", *args], capture_output=True, text=True,
                                               timeout=300, env={**federation.env,
                                                                 "PATH": f"{BIN}:{os.environ['PATH']}"})
                                for args in register)
    assert unnamed.returncode == 1 and "certs.sh register --name supernode-<i>" in unnamed.stderr, unnamed.stderr
    assert taken.returncode == 1 and "'supernode-0': that name is registered already" in taken.stderr, taken.stderr
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    added = [node["status"] for node in federation.nodes() if node["node-id"] not in after]
    assert added == ["registered"]  # site 1's new key, and nothing else


def test_the_control_api_listens_on_this_host_only_by_default(tmp_path):
    """superlink.sh without --control-address: the Control API (9093) is bound to 127.0.0.1,
    the Fleet API (9092) to every interface, for the sites."""
    require_linux()
    certs = create_certificates(tmp_path / "certs", 1)
    env = Workstation(tmp_path / "home", "127.0.0.1:9093", certs / "ca.crt").env
    superlink = subprocess.Popen([str(ROOT / "deploy" / "superlink.sh"), "--certs", str(certs),
                                  "--state", str(tmp_path / "state"), "--database", "memory"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
    try:
        Workstation(tmp_path / "home", "127.0.0.1:9093", certs / "ca.crt").wait_until_reachable(
            alive=lambda: superlink.poll() is None)
        listening = _listening_addresses()
        assert listening.get(9093) == {"127.0.0.1"}, listening
        assert listening.get(9092, set()) & {"0.0.0.0", "::"}, listening
    finally:
        stop_groups(superlink)


def _listening_addresses() -> dict[int, set[str]]:
    """Port -> the addresses sockets listen on (``::`` for IPv6's any), from /proc/net/tcp and
    tcp6 (state 0A: LISTEN)."""
    listening: dict[int, set[str]] = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":
                continue
            address, port = local.split(":")
            listening.setdefault(int(port, 16), set()).add(_readable(address))
    return listening


def _readable(address: str) -> str:
    if len(address) == 8:  # IPv4, little-endian
        return ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    if int(address, 16) == 0:
        return "::"
    if address == "00000000000000000000000001000000":
        return "::1"
    return address
