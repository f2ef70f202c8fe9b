"""What a deployed site depends on, without a deployment: one normalization for every client,
the personalized model a site keeps and its predict entry point, the launchers' patches of
Flower (which must fail loudly if Flower changes) and their long polls, the host's training
slots, and the packed records every message carries."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import multiprocessing
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import flwr.supernode.start_client_internal as supernode_loop
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from client_app import site_model
from client_app.app import client_tensors, sealed_replies
from common.config import ConfigError, parse_run_config
from common.data import DATASET_NORMALIZATION, DataError, load_embedded_mnist, normalization, run_normalization
from common import protocol
from common.model import FedPACNet
from server_app.responsive_grid import ResponsiveGrid
from tests.deployment import ROOT, process_gone

sys.path.insert(0, str(ROOT / "deploy"))
import fast_supernode  # noqa: E402  pylint: disable=wrong-import-position
import long_poll  # noqa: E402  pylint: disable=wrong-import-position
import patient_superlink  # noqa: E402  pylint: disable=wrong-import-position
import warm_executor  # noqa: E402  pylint: disable=wrong-import-position


def test_named_datasets_normalize_with_their_training_sets_statistics():
    mean, std = normalization(load_embedded_mnist().train_images)
    expected = ((pytest.approx(mean[0], abs=1e-15),), (pytest.approx(std[0], abs=1e-15),))
    assert DATASET_NORMALIZATION["mnist-5k"] == expected
    assert set(DATASET_NORMALIZATION) == {"mnist-5k", "fashion-mnist", "mnist", "cifar10"}


def test_run_config_normalization_wins_and_a_dataset_without_constants_needs_it():
    cfg = parse_run_config({"dataset": "hf", "data-dir": "/nowhere", "normalize-mean": "0.5",
                            "normalize-std": "0.25"})
    mean, std = run_normalization(cfg)
    assert mean.tolist() == [0.5] and std.tolist() == [0.25]
    with pytest.raises(DataError, match="normalize-mean and normalize-std"):
        run_normalization(parse_run_config({"dataset": "hf", "data-dir": "/nowhere"}))
    with pytest.raises(ConfigError, match="normalize-std"):
        parse_run_config({"normalize-mean": "0.5"})
    with pytest.raises(ConfigError, match="normalize-mean"):
        parse_run_config({"normalize-mean": "0.5,0.5", "normalize-std": "0.2,0.2"})  # 1 channel
    with pytest.raises(ConfigError, match="normalize-std"):
        parse_run_config({"normalize-mean": "0.5", "normalize-std": "0"})


def test_a_site_with_its_own_data_normalizes_like_everyone_else(tmp_path):
    """A site whose images are all bright is not rescaled by its own statistics."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("test", 10)):
        np.savez(tmp_path / f"{split}.npz", x=rng.integers(200, 256, (n, 28, 28), dtype=np.uint8),
                 y=np.arange(n) % 10)
    cfg = parse_run_config({})
    x, _, _, _ = client_tensors(cfg, 0, 1, torch.device("cpu"), str(tmp_path))
    with np.load(tmp_path / "train.npz") as train:
        pixels = train["x"].astype(np.float64) / 255.0
    (mean,), (std,) = DATASET_NORMALIZATION["mnist-5k"]
    np.testing.assert_allclose(x[:, 0].numpy(), (pixels - mean) / (std + 1e-8), rtol=1e-5)
    assert x.mean().item() > 2  # far from zero: the site's own mean was not subtracted


@pytest.mark.parametrize("front_end", ["none", "scatternet"])
def test_a_saved_site_model_predicts_like_the_model_it_saved(tmp_path, front_end):
    """A site's saved model, loaded back, gives the saved model's probabilities for raw images:
    normalized as the run normalized them and, with a front end, scattered first (kymatio's
    transform, computed here independently)."""
    torch.manual_seed(0)
    model = FedPACNet(1, 28, 10, front_end).eval()
    (mean,), (std,) = DATASET_NORMALIZATION["mnist-5k"]
    info = site_model.SiteModel(method="fedpac", run_id=7, round=3, partition_id=2, accuracy=0.5,
                                num_classes=10, image_size=28, image_channels=1, mean=[mean], std=[std],
                                front_end=front_end)
    site_model.save_site_model(tmp_path / "site", model, info, run_complete=True)
    # no .tmp left: the current model's copies, the pointer to its run, and the run's own folder
    assert sorted(p.name for p in (tmp_path / "site").iterdir()) == ["current", "model.json", "model.pt", "runs"]
    assert sorted(p.name for p in (tmp_path / "site" / "runs" / "7").iterdir()) == ["model.json", "model.pt"]
    loaded, loaded_info = site_model.load_site_model(tmp_path / "site")
    assert dataclasses.replace(loaded_info, saved_at=0.0) == info and loaded_info.saved_at > 0
    images = np.random.default_rng(1).integers(0, 256, (6, 28, 28), dtype=np.uint8)
    labels, probabilities = site_model.predict(loaded, loaded_info, images)
    x = (torch.from_numpy(images).float()[:, None] / 255 - mean) / (std + 1e-8)
    if front_end == "scatternet":
        x = ScatteringTorch2D(J=2, shape=(28, 28))(x).flatten(1, 2)
    with torch.no_grad():
        expected = torch.softmax(model(x), dim=1).numpy()
    np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=1e-6)
    assert labels.tolist() == expected.argmax(axis=1).tolist()
    with pytest.raises(ValueError, match="uint8"):
        site_model.predict(loaded, loaded_info, images.astype(np.float32))


def test_predict_command_reads_a_folder_of_images_and_reports_errors(tmp_path, capsys):
    from PIL import Image

    model = FedPACNet(1, 28, 10)
    info = site_model.SiteModel(method="fedper", run_id=1, round=1, partition_id=0, accuracy=0.1,
                                num_classes=10, image_size=28, image_channels=1, mean=[0.1], std=[0.3])
    site_model.save_site_model(tmp_path / "site", model, info, run_complete=True)
    (tmp_path / "images").mkdir()
    for i in range(3):
        Image.fromarray(np.full((28, 28), 40 * i, dtype=np.uint8)).save(tmp_path / "images" / f"{i}.png")
    assert site_model.main([str(tmp_path / "site"), str(tmp_path / "images")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "image,class,confidence"
    assert [line.split(",")[0] for line in lines[1:]] == ["0.png", "1.png", "2.png"]
    assert site_model.main([str(tmp_path / "nothing"), str(tmp_path / "images")]) == 2
    assert "holds no site model" in capsys.readouterr().err
    assert json.loads((tmp_path / "site" / "model.json").read_text())["method"] == "fedper"


def test_fast_supernode_shortens_exactly_the_waits_flowers_loop_has():
    source = inspect.getsource(supernode_loop)
    assert "time.sleep(3)" in source and "time.sleep(0.5)" in source  # else the launcher is stale
    slept = []
    sleep = fast_supernode.shortened_sleep(0.5)
    original = fast_supernode.time.sleep
    fast_supernode.time.sleep = slept.append
    try:
        for seconds in (3, 0.5, 1.25):
            sleep(seconds)
    finally:
        fast_supernode.time.sleep = original
    assert slept == [0.5, 0.1, 1.25]
    patched = fast_supernode.patched_time_module(0.5)
    assert patched.time is fast_supernode.time.time and patched.sleep is not fast_supernode.time.sleep


def test_patient_superlink_raises_exactly_flowers_sqlite_busy_timeout():
    import flwr.supercore.sql_mixin as sql_mixin

    assert ("busy_timeout", "5000") in sql_mixin.SQLITE_PRAGMAS  # else the launcher is stale
    patched = dict(patient_superlink.with_busy_timeout(sql_mixin.SQLITE_PRAGMAS, 60000))
    assert patched == {**dict(sql_mixin.SQLITE_PRAGMAS), "busy_timeout": "60000"}
    with pytest.raises(RuntimeError, match="busy_timeout"):
        patient_superlink.with_busy_timeout((("journal_mode", "WAL"),), 60000)


def _until(condition, timeout: float = 5.0) -> None:  # noqa: ANN001
    """Wait for ``condition()`` (a waiter registered, say) instead of sleeping a guessed time."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_long_poll_answers_as_soon_as_something_is_stored_and_empty_only_after_its_wait():
    poll = long_poll.LongPoll(wait=1.0)
    store: list[str] = []
    put = poll.producer(store.append)
    take = poll.handler(lambda: list(store), answered=bool)

    started = time.monotonic()
    assert take() == [] and 0.95 <= time.monotonic() - started < 1.5  # nothing came: empty after the wait

    threading.Timer(0.2, put, args=("message",)).start()
    started = time.monotonic()
    assert take() == ["message"] and time.monotonic() - started < 0.5  # woken by the store, not the wait

    off = long_poll.LongPoll(wait=0.0).handler(lambda: [], answered=bool)
    started = time.monotonic()
    assert off() == [] and time.monotonic() - started < 0.1
    with pytest.raises(ValueError, match="0 to 25"):
        long_poll.LongPoll(wait=60)


def test_long_poll_answers_at_once_beyond_its_waiting_bound():
    poll = long_poll.LongPoll(wait=1.0, max_waiting=1)
    take = poll.handler(lambda: [], answered=bool)
    first = threading.Thread(target=take)
    first.start()
    _until(lambda: poll._waiting == 1)  # pylint: disable=protected-access
    started = time.monotonic()
    assert take() == [] and time.monotonic() - started < 0.2  # the one waiting slot is taken
    first.join()


class _Store:
    """An object store as Flower's pull handlers see it: announced objects are b"" until put."""

    def __init__(self, announced: list[str]) -> None:
        self.objects = {object_id: b"" for object_id in announced}

    def put(self, object_id: str, content: bytes) -> None:
        self.objects[object_id] = content


def _pull_object_handler(store: _Store):  # noqa: ANN202
    from flwr.proto.message_pb2 import PullObjectResponse  # pylint: disable=no-name-in-module

    def pull_object(request, state=None, task=None):  # noqa: ANN001, ANN202, ARG001  # Flower's signature
        content = store.objects.get(request.object_id)
        if content is None:
            return PullObjectResponse(object_found=False, object_available=False)
        return PullObjectResponse(object_found=True, object_available=content != b"", object_content=content)

    return pull_object


def test_an_early_object_pull_waits_for_that_object_and_no_other(monkeypatch):
    """Flower's puller backs off a whole second after "not available yet": a pull that waits
    is answered as soon as its object is stored, not by another object, and never for an
    object nobody announced."""
    from flwr.proto.message_pb2 import PullObjectRequest  # pylint: disable=no-name-in-module

    arrivals = long_poll.ObjectArrivals(wait=1.0)
    monkeypatch.setattr(_Store, "put", arrivals.producer(_Store.put))
    store = _Store(["a", "b"])
    pull = arrivals.handler(_pull_object_handler(store), long_poll.object_answered)

    threading.Timer(0.2, store.put, args=("b", b"other")).start()
    threading.Timer(0.4, store.put, args=("a", b"payload")).start()
    started = time.monotonic()
    response = pull(request=PullObjectRequest(object_id="a"))  # as the Fleet servicer calls it
    assert response.object_available and response.object_content == b"payload"
    assert 0.35 <= time.monotonic() - started < 0.95  # woken by "a" (not by "b" at 0.2 s), before the wait ends
    assert arrivals._waiters == {}  # pylint: disable=protected-access  # nothing left behind

    started = time.monotonic()
    unknown = pull(PullObjectRequest(object_id="nobody-announced-it"), None, None)  # as the Runtime API
    assert not unknown.object_found and time.monotonic() - started < 0.1

    store.objects["late"] = b""
    started = time.monotonic()
    assert not pull(PullObjectRequest(object_id="late")).object_available
    assert 0.95 <= time.monotonic() - started < 1.5  # still not there: "not available" after the wait

    off = long_poll.ObjectArrivals(wait=0.0).handler(_pull_object_handler(store), long_poll.object_answered)
    started = time.monotonic()
    assert not off(PullObjectRequest(object_id="late")).object_available and time.monotonic() - started < 0.1


def test_object_pulls_of_many_waiters_all_wake_and_beyond_the_bound_answer_at_once(monkeypatch):
    from flwr.proto.message_pb2 import PullObjectRequest  # pylint: disable=no-name-in-module

    arrivals = long_poll.ObjectArrivals(wait=2.0, max_waiting=3)
    monkeypatch.setattr(_Store, "put", arrivals.producer(_Store.put))
    store = _Store(["x"])
    pull = arrivals.handler(_pull_object_handler(store), long_poll.object_answered)
    answers: list[bool] = []
    waiting = [threading.Thread(target=lambda: answers.append(pull(PullObjectRequest(object_id="x")).object_available))
               for _ in range(3)]
    for thread in waiting:
        thread.start()
    _until(lambda: arrivals._waiting == 3)  # pylint: disable=protected-access
    started = time.monotonic()
    assert not pull(PullObjectRequest(object_id="x")).object_available  # a fourth: the bound is 3
    assert time.monotonic() - started < 0.1
    store.put("x", b"data")
    woken_by = time.monotonic() + 0.5  # all three by the store, long before their 2 s wait ends
    for thread in waiting:
        thread.join(timeout=max(0.0, woken_by - time.monotonic()))
    assert not any(thread.is_alive() for thread in waiting)
    assert answers == [True, True, True]


def test_launchers_make_flowers_pull_handlers_long_polls(monkeypatch):
    """The patch points exist in this Flower (else the launchers are stale) and get wrapped."""
    from flwr.server.superlink.fleet.message_handler import message_handler
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.superlink.servicer.runtime import runtime_handlers as link_handlers
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState
    from flwr.supernode.servicer.runtime import runtime_handlers as node_handlers

    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
    from flwr.supercore.object_store.sql_object_store import SqlObjectStore

    points = [(message_handler, "pull_messages"), (link_handlers, "pull_messages"), (node_handlers, "acquire_task"),
              (message_handler, "pull_object"), (link_handlers, "pull_object"), (node_handlers, "pull_object"),
              (InMemoryObjectStore, "put"), (SqlObjectStore, "put")]
    for owner, name in points + [(InMemoryNodeState, "create_task"), (InMemoryLinkState, "store_message_ins"),
                                 (InMemoryLinkState, "store_message_res")]:
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    originals = [getattr(owner, name) for owner, name in points]
    patient_superlink.long_poll_messages(1.0)
    patient_superlink.long_poll_objects(1.0)
    fast_supernode.long_poll_tasks(1.0)
    fast_supernode.long_poll_objects(1.0)
    wrapped = [getattr(owner, name) for owner, name in points]
    # each launcher wraps what it serves (the stores twice here: both launchers in one process)
    assert all(new is not old and inspect.unwrap(new) is old for new, old in zip(wrapped, originals))


def test_a_node_waits_for_its_clientapps_reply_as_a_long_poll(monkeypatch):
    from flwr.app import ConfigRecord, Message, MessageType
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    for name in ("store_message", "get_messages"):
        monkeypatch.setattr(InMemoryNodeState, name, getattr(InMemoryNodeState, name))
    for name in ("run_id", "task_id", "node_id"):
        monkeypatch.setattr(TaskIdentity, f"_{name}", 1)
    fast_supernode.long_poll_replies(1.0)
    state = InMemoryNodeState(InMemoryObjectStore())

    def stored(message: Message) -> Message:
        message.metadata.__dict__["_message_id"] = message.object_id  # as the node loop does
        return message

    ins = stored(Message(content=RecordDict({"c": ConfigRecord({"a": 1})}), message_type=MessageType.TRAIN,
                         dst_node_id=1))
    state.store_message(ins)
    started = time.monotonic()
    assert len(state.get_messages(is_reply=False)) == 1 and time.monotonic() - started < 0.1  # unchanged
    started = time.monotonic()
    assert state.get_messages(is_reply=True) == [] and 0.95 <= time.monotonic() - started < 1.5
    reply = stored(Message(content=RecordDict({"c": ConfigRecord({"b": 2})}), reply_to=ins))
    threading.Timer(0.2, state.store_message, args=(reply,)).start()
    started = time.monotonic()
    assert len(state.get_messages(is_reply=True)) == 1 and time.monotonic() - started < 0.6  # woken by it


def test_fast_supernode_removes_exactly_the_periodic_wakeups_flower_and_uvicorn_have():
    import flwr.client.grpc_rere_client.connection as fleet_connection
    import uvicorn

    # the patch points are still there (else the launcher is stale)
    assert "channel.subscribe(on_channel_state_change)" in inspect.getsource(fleet_connection)
    assert "await asyncio.sleep(0.1)" in inspect.getsource(uvicorn.Server.main_loop)
    created = fleet_connection.create_channel
    arguments = {"server_address": "127.0.0.1:1", "insecure": True, "root_certificates": None,
                 "max_message_length": 1024}

    def threads_after_subscribing(channel) -> int:
        before = threading.active_count()
        channel.subscribe(lambda state: None)
        time.sleep(0.3)
        started = threading.active_count() - before
        channel.close()
        return started

    try:
        fast_supernode.without_connectivity_polling()
        assert threads_after_subscribing(fleet_connection.create_channel(**arguments)) == 0
    finally:
        fleet_connection.create_channel = created
    assert threads_after_subscribing(created(**arguments)) == 1  # grpcio's polling thread

    class Ticking:
        ticks: list[int] = []

        async def on_tick(self, counter: int) -> bool:
            self.ticks.append(counter)
            return len(self.ticks) == 3

    started = time.monotonic()
    asyncio.run(fast_supernode._main_loop_every_second(Ticking()))  # pylint: disable=protected-access
    assert Ticking.ticks == [0, 10, 20] and 1.9 <= time.monotonic() - started < 2.5  # the header each tick


def test_host_slots_let_at_most_count_holders_in_at_once(tmp_path):
    slots = warm_executor.HostSlots(tmp_path / "slots", 2)
    inside, most = [0], [0]
    lock = threading.Lock()

    def hold() -> None:
        with slots.held():
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.1)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=hold) for _ in range(6)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 2 and time.monotonic() - started >= 0.29  # three waves of two
    with warm_executor.HostSlots(tmp_path / "unused", 0).held():  # 0: no limit, no files
        assert not (tmp_path / "unused").exists()


def test_host_slot_waiters_wait_in_line_and_only_the_first_looks_for_a_free_slot(tmp_path, monkeypatch):
    slots = warm_executor.HostSlots(tmp_path / "slots", 1, retry_interval=0.02)
    looks = [0]
    take_one = warm_executor.HostSlots._take_one  # pylint: disable=protected-access

    def counted(self):  # noqa: ANN001, ANN202
        looks[0] += 1
        return take_one(self)

    monkeypatch.setattr(warm_executor.HostSlots, "_take_one", counted)
    order: list[int] = []
    first_holds = threading.Event()

    def hold(number: int) -> None:
        with slots.held():
            order.append(number)
            first_holds.set()
            time.sleep(0.1)

    first = threading.Thread(target=hold, args=(0,))
    first.start()
    assert first_holds.wait(timeout=30)  # the others arrive while the only slot is taken
    waiting = [threading.Thread(target=hold, args=(n,)) for n in range(1, 6)]
    for thread in waiting:
        thread.start()
    for thread in [first, *waiting]:
        thread.join()
    assert sorted(order) == list(range(6))
    # 0.5 s of waiting: one waiter looking every 0.02 s is about 25 looks (+ one on arrival each);
    # five waiters all looking would be about 5 x 25 / 2 = 60
    assert looks[0] < 45, looks[0]


def test_packed_records_keep_names_dtypes_and_shapes_in_one_array():
    arrays = {"extractor.0.weight": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
              "client-3/head.bias": np.array([1, 2], dtype=np.int64), "mask": np.array([True, False])}
    record = protocol.to_record(arrays)
    assert list(record) == [protocol.PACKED]
    back = protocol.from_record(record)
    assert list(back) == list(arrays)
    for key, value in arrays.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value)
    plain = ArrayRecord(array_dict={"w": Array(np.ones(3))})  # Flower's own form is still read
    assert list(protocol.from_record(plain)) == ["w"]


def test_a_message_carries_all_its_arrays_in_one_record_by_section():
    model = {"extractor.0.weight": np.ones((2, 3), dtype=np.float32), "head.bias": np.zeros(2, dtype=np.float32)}
    stats = {protocol.H: np.arange(4, dtype=np.float64).reshape(2, 2), protocol.CLASS_COUNTS: np.array([3, 0])}
    record = protocol.pack({protocol.MODEL: model, protocol.STATISTICS: stats, protocol.CENTROIDS: {}})
    assert list(record) == [protocol.PACKED]  # one Array: one object per hop for all of them
    sections = protocol.unpack(record)
    assert list(sections) == [protocol.MODEL, protocol.STATISTICS]  # the empty section is left out
    for section, arrays in ((protocol.MODEL, model), (protocol.STATISTICS, stats)):
        assert list(sections[section]) == list(arrays)
        for key, value in arrays.items():
            assert sections[section][key].dtype == value.dtype and np.array_equal(sections[section][key], value)
    content = RecordDict({protocol.ARRAYS: record})
    assert protocol.sections_of(content)[protocol.MODEL].keys() == model.keys()
    assert protocol.sections_of(RecordDict()) == {}
    with pytest.raises(ValueError, match="section name"):
        protocol.pack({"a/b": model})
    with pytest.raises(ValueError, match="not named <section>/<array>"):
        protocol.unpack(protocol.to_record({"h": np.zeros(2)}))


def _train_content() -> RecordDict:
    model = {"extractor.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "head.bias": np.ones(2, np.float32)}
    return RecordDict({protocol.ARRAYS: protocol.pack({protocol.MODEL: model}),
                       protocol.CONFIG: ConfigRecord({protocol.SERVER_ROUND: 3, "name": "x", "flag": True}),
                       protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 600, "loss": 0.25})})


def test_a_sealed_message_is_three_objects_and_opens_to_the_same_records():
    content = _train_content()
    sealed = protocol.seal(content)
    assert protocol.is_sealed(sealed) and not protocol.is_sealed(content)
    message = Message(sealed, dst_node_id=1, message_type="train")
    # the message, its RecordDict and the envelope, against 7 objects unsealed
    assert len(get_all_nested_objects(message)) == 3
    assert len(get_all_nested_objects(Message(content, dst_node_id=1, message_type="train"))) == 7
    opened = protocol.unseal(sealed)
    assert list(opened) == list(content)
    assert dict(opened[protocol.CONFIG]) == dict(content[protocol.CONFIG])
    assert dict(opened[protocol.METRICS]) == dict(content[protocol.METRICS])
    arrays = protocol.sections_of(opened)[protocol.MODEL]
    for key, value in protocol.sections_of(content)[protocol.MODEL].items():
        assert arrays[key].dtype == value.dtype and np.array_equal(arrays[key], value)
    # larger than the limit (Flower's array chunk by default): left for Flower to chunk
    assert protocol.seal(content, max_bytes=100) is content


@pytest.mark.parametrize("content, reason", [
    (RecordDict({protocol.ENVELOPE: ConfigRecord({protocol.ENVELOPE: b"\xff\x00garbage"})}), "serialized records"),
    (RecordDict({protocol.ENVELOPE: ConfigRecord({protocol.ENVELOPE: "text"})}), "one bytes entry"),
    (RecordDict({protocol.ENVELOPE: ConfigRecord({protocol.ENVELOPE: b"", "more": 1})}), "one bytes entry"),
    (RecordDict({protocol.CONFIG: ConfigRecord({"a": 1})}), "not a sealed message"),
])
def test_a_malformed_envelope_is_an_error_that_names_it(content, reason):
    with pytest.raises(ValueError, match=reason):
        protocol.unseal(content)


class _Deployment(Grid):  # a deployment's grid: stores what it is pushed, answers with ``replies``
    def __init__(self, replies: list[Message]) -> None:
        self.pushed: list[Message] = []
        self.replies = replies

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        self.pushed.extend(messages)
        return [str(n) for n, _ in enumerate(self.pushed)]

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        return self.replies

    set_run = run = create_message = get_node_ids = get_nodes = send_and_receive = None  # type: ignore[assignment]


def test_a_deployed_server_seals_what_it_sends_and_opens_replies_and_refuses_a_bad_envelope(monkeypatch):
    request = Message(_train_content(), dst_node_id=1, message_type="train")
    good = Message(protocol.seal(_train_content()), dst_node_id=1, message_type="train")
    bad = Message(RecordDict({protocol.ENVELOPE: ConfigRecord({protocol.ENVELOPE: b"\xff\x00"})}),
                  dst_node_id=2, message_type="train")
    plain = Message(_train_content(), dst_node_id=3, message_type="train")
    deployment = _Deployment([good, bad, plain])
    grid = ResponsiveGrid(deployment)
    assert grid.seal
    grid.push_messages([request])
    assert protocol.is_sealed(deployment.pushed[0].content)
    opened, refused, unchanged = grid.pull_messages(["0"])
    assert list(opened.content) == [protocol.ARRAYS, protocol.CONFIG, protocol.METRICS]
    assert refused.has_error() and "malformed reply" in refused.error.reason
    assert unchanged is plain
    monkeypatch.setenv("FEDPAC_SEAL_MESSAGES", "0")
    assert not ResponsiveGrid(_Deployment([])).seal
    monkeypatch.delenv("FEDPAC_SEAL_MESSAGES")
    assert not ResponsiveGrid(InMemoryGrid.__new__(InMemoryGrid)).seal  # the simulation's grid


def test_a_sealed_reply_larger_than_any_reply_can_be_is_refused_before_it_is_parsed(monkeypatch):
    big = Message(protocol.seal(_train_content()), dst_node_id=1, message_type="train")
    size = protocol.payload_bytes(big.content)
    parsed = []
    unseal = protocol.unseal
    monkeypatch.setattr(protocol, "unseal", lambda content: parsed.append(content) or unseal(content))
    grid = ResponsiveGrid(_Deployment([big]), reply_limit=lambda: size - 1)
    (refused,) = grid.pull_messages(["0"])
    assert refused.has_error() and f"{size:,} bytes, more than the {size - 1:,}" in refused.error.reason
    assert "refused before any of it was decoded" in refused.error.reason and parsed == []
    grid.reply_limit = lambda: size  # at the limit: opened
    (opened,) = grid.pull_messages(["0"])
    assert not opened.has_error() and len(parsed) == 1


def test_the_client_app_answers_a_sealed_message_with_a_sealed_reply_and_a_plain_one_plainly():
    seen: list[RecordDict] = []

    def handler(msg: Message, context) -> Message:  # noqa: ANN001
        seen.append(msg.content)
        return Message(RecordDict({protocol.METRICS: MetricRecord({"accuracy": 0.5})}), reply_to=msg)

    for sealed in (True, False):
        content = _train_content()
        msg = Message(protocol.seal(content) if sealed else content, dst_node_id=1, message_type="train")
        msg.metadata.__dict__["_message_id"] = msg.object_id
        reply = sealed_replies(msg, None, handler)  # type: ignore[arg-type]
        assert list(seen[-1]) == [protocol.ARRAYS, protocol.CONFIG, protocol.METRICS]
        assert protocol.is_sealed(reply.content) is sealed
        back = protocol.unseal(reply.content) if sealed else reply.content
        assert dict(back[protocol.METRICS]) == {"accuracy": 0.5}


def test_a_worker_whose_executor_died_exits_even_in_the_middle_of_a_task(tmp_path):
    # An executor killed while its worker runs a task (here: one that never ends) has no time to
    # stop the worker; before, such workers lived on with their memory and host slots.
    (tmp_path / "busy_worker.py").write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'deploy')!r})\n"
        "import warm_executor\n"
        "def task(executor):\n"
        "    warm_executor._exit_with_parent(executor, direct=True)\n"
        "    time.sleep(120)\n"
    )
    executor = subprocess.Popen(
        [sys.executable, "-c",
         "import multiprocessing, os, sys, time; sys.path.insert(0, sys.argv[1]); import busy_worker\n"
         "if __name__ == '__main__':\n"
         "    worker = multiprocessing.get_context('spawn').Process(target=busy_worker.task, args=(os.getpid(),))\n"
         "    worker.start()\n"
         "    print(worker.pid, flush=True); time.sleep(120)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        worker = int(executor.stdout.readline())
        executor.kill()  # the worker may still be starting: it must go all the same
        executor.wait()
        deadline = time.monotonic() + 10
        while not process_gone(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process_gone(worker)
    finally:
        executor.kill()


def test_every_worker_watches_its_executor(monkeypatch):
    watched: list[tuple[int, bool]] = []
    monkeypatch.setattr(warm_executor, "_exit_with_parent", lambda pid, direct: watched.append((pid, direct)))
    ours, theirs = multiprocessing.Pipe()
    ours.close()  # the executor is gone: the worker's loop ends at once
    endpoint = warm_executor.RuntimeEndpoint("127.0.0.1:1", True, None)
    warm_executor.worker_main(theirs, endpoint, warm_executor.WorkerOptions(), 4242)
    assert watched == [(4242, True)]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")  # Flower's own use of pathspec
def test_the_app_bundle_a_site_receives_holds_the_apps_packages_only():
    """The FAB travels to every ClientApp with every message: it carries what the apps import,
    not the tests, benchmarks, experiments, docs and results of this repository. Built the way
    `flwr run` builds it (`flwr build` would also demand that the checkout's folder name be a
    valid app name, which a clone into, say, a `mktemp -d` folder is not)."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(ROOT)
    members = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    packages = {name.split("/")[0] for name in members if "/" in name}
    assert packages == {"common", "server_app", "client_app", ".info"}, packages
    # every registered method's package with its client and server parts: the apps find them by
    # the run's strategy
    from common.methods import METHODS  # pylint: disable=import-outside-toplevel

    packages_of_methods = {type(method).__module__.replace(".", "/") for method in METHODS.values()}
    methods = [f"{package}/{part}.py" for package in packages_of_methods for part in ("__init__", "client", "server")]
    assert len(methods) >= 18
    assert {"server_app/app.py", "client_app/app.py", "common/methods/__init__.py", "common/methods/base.py",
            "common/methods/client.py", "common/methods/server.py", "common/training.py", *methods,
            "pyproject.toml"} <= set(members)
    # Flower stores the files uncompressed: the three packages' own code is about 0.55 MB; anything
    # else (a test, a result, a dataset) would show here first. Flower's own limit is 10 MB.
    assert len(fab) < 800_000


def test_a_revoked_nodes_exit_stays_clean_when_its_heartbeat_thread_ended_first(monkeypatch):
    """The heartbeat thread may see the SuperLink's refusal of a revoked key before the main
    loop does and end; stopping it at the node's exit must not raise (Flower 1.39 raises, the
    node then exits with status 1 and supernode.sh restarts a revoked node)."""
    from flwr.supercore.heartbeat import HeartbeatSender

    def ended_sender() -> HeartbeatSender:
        sender = HeartbeatSender(lambda: (_ for _ in ()).throw(RuntimeError("Invalid node ID")))
        sender.start()
        sender._thread.join(timeout=10)  # the thread died of the refusal  # noqa: SLF001
        assert not sender._thread.is_alive()  # noqa: SLF001
        return sender

    with pytest.raises(RuntimeError, match="Heartbeat sender is not running"):
        ended_sender().stop()  # Flower's own stop
    monkeypatch.setattr(HeartbeatSender, "stop", HeartbeatSender.stop)  # restored after the test
    fast_supernode.tolerant_heartbeat_stop()
    sender = ended_sender()
    sender.stop()
    assert not sender.is_running
    beats: list[float] = []
    running = HeartbeatSender(lambda: beats.append(time.monotonic()) or True)
    running.start()
    running.stop()  # a live sender is still stopped and joined
    assert not running._thread.is_alive() and beats  # noqa: SLF001
