"""What a site keeps at home (``common.site_state``, ``common.methods.client.site_model_state``):
stored by round, found across the runs of a lineage, never under a path the server names."""

import numpy as np
import pytest

from common.methods import METHODS
from common.methods.client import site_model_state
from common.site_state import KEPT_ROUNDS, SiteStore, check_lineage


def _kept(value: float) -> dict:
    return {"model": {"head.bias": np.full(3, value, np.float32)}, "ditto": {"w": np.array([value])}}


def _value(kept: dict) -> float:
    return float(kept["model"]["head.bias"][0])


def test_a_site_finds_the_newest_round_up_to_the_one_asked_for(tmp_path):
    store = SiteStore(tmp_path, 4, (("run-a", 1),))
    assert store.load(5) == {}
    for server_round in (1, 2, 3):
        store.save(server_round, _kept(server_round))
    assert _value(store.load(3)) == 3 and _value(store.load(2)) == 2 and _value(store.load(99)) == 3
    assert store.load(0) == {}
    loaded = store.load(3)
    assert sorted(loaded) == ["ditto", "model"] and loaded["ditto"]["w"][0] == 3.0
    assert loaded["model"]["head.bias"].dtype == np.float32
    # only the newest rounds stay on disk, in the partition's own folder
    assert sorted(f.name for f in (tmp_path / "run-a" / "partition-4").iterdir()) == \
        [f"round-{t}.npz" for t in range(4 - KEPT_ROUNDS, 4)]
    assert SiteStore(tmp_path, 5, (("run-a", 1),)).load(3) == {}  # another partition's


def test_a_resumed_run_starts_from_the_round_its_checkpoint_holds_not_the_interrupted_one(tmp_path):
    """The interrupted run trained round 3 at this site, but its server checkpointed round 2 only:
    the resumed run (first round 3) starts from round 2's state, then keeps its own."""
    interrupted = SiteStore(tmp_path, 0, (("run-a", 1),))
    for server_round in (1, 2, 3):
        interrupted.save(server_round, _kept(server_round))
    resumed = SiteStore(tmp_path, 0, (("run-a", 1), ("run-b", 3)))
    assert _value(resumed.load(2)) == 2  # round 3's train message reads what was kept after round 2
    # asked for round 3 before it trained there (evaluated first), the site still holds round 2's
    # state: the interrupted run's round 3 is not the resumed run's
    assert _value(resumed.load(3)) == 2
    resumed.save(3, _kept(30))
    assert _value(resumed.load(3)) == 30 and _value(interrupted.load(3)) == 3
    # a site that never trained in the resumed run still finds what it kept in the earlier one
    assert _value(resumed.load(7)) == 30
    assert _value(SiteStore(tmp_path, 0, (("run-a", 1), ("run-b", 3), ("run-c", 9))).load(20)) == 30


def test_a_site_two_rounds_past_the_server_s_checkpoint_still_has_its_state_after_it(tmp_path):
    """With fused evaluation round 6 is checkpointed only once round 7's replies are in: a server
    stopped during round 7 resumes after round 5 while its sites saved rounds 6 and 7 already.
    They must still hold round 5 (a privacy ledger or a kept head lost there would start over)."""
    interrupted = SiteStore(tmp_path, 0, (("run-a", 1),))
    for server_round in range(1, 8):
        interrupted.save(server_round, _kept(server_round))
    resumed = SiteStore(tmp_path, 0, (("run-a", 1), ("run-b", 6)))
    assert _value(resumed.load(5)) == 5


@pytest.mark.parametrize("runs, starts, problem", [
    (["../../etc"], [1], "not a plain name"),
    (["a/b"], [1], "not a plain name"),
    ([""], [1], "not a plain name"),
    ([".hidden"], [1], "not a plain name"),
    (["x" * 129], [1], "not a plain name"),
    ([3], [1], "not a plain name"),
    (["a"], [0], "not a positive integer"),
    (["a"], [True], "not a positive integer"),
    (["a"], [1.0], "not a positive integer"),
    (["a", "b"], [3, 3], "do not increase"),
    (["a", "a"], [1, 2], "names a run twice"),
    (["a", "b"], [1], "2 run(s) and 1 first round(s)"),
    ([], [], "0 run(s)"),
])
def test_a_lineage_that_could_name_another_folder_or_makes_no_sense_is_refused(runs, starts, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        check_lineage(runs, starts)


def test_a_good_lineage_passes():
    runs = ["20261128-011500-run1-ab12", "b.c_d"]
    assert check_lineage(runs, [1, 5]) == ((runs[0], 1), (runs[1], 5))


def _state(value: float) -> dict:
    return {"extractor.0.weight": np.full(2, value), "head.weight": np.full(2, value + 0.5)}


def test_the_site_model_takes_the_shared_parts_as_sent_and_its_own_parts_as_kept():
    fedper = METHODS["fedper"]
    received, kept, initial = _state(1.0), _state(2.0), _state(3.0)
    model = site_model_state(fedper, received, kept, lambda: initial)
    assert model["extractor.0.weight"][0] == 1.0 and model["head.weight"][0] == 2.5
    # before the site first trained: the run's round-0 head; a head the server sends is ignored
    model = site_model_state(fedper, received, None, lambda: initial)
    assert model["head.weight"][0] == 3.5
    # Local-only: nothing from the server; FedAvg: everything from it
    assert site_model_state(METHODS["local"], {}, kept, lambda: initial)["extractor.0.weight"][0] == 2.0
    model = site_model_state(METHODS["fedavg"], received, kept, lambda: pytest.fail("not needed"))
    assert model["head.weight"][0] == 1.5


def test_a_message_without_a_part_the_method_shares_is_an_error():
    with pytest.raises(ValueError, match="lacks the extractor that fedper shares"):
        site_model_state(METHODS["fedper"], {"head.weight": np.zeros(2)}, None, lambda: _state(0.0))


def test_a_run_s_rounds_only_go_forward_and_the_same_round_may_come_again(tmp_path):
    """A message naming an earlier round than the run's newest kept one is refused (it is not the
    server's run going on); the same round again (an evaluation after the training, an honest
    repeat) and any later one pass."""
    store = SiteStore(tmp_path, 0, (("run-a", 1),))
    store.check_round(1)  # nothing kept yet
    store.save(3, _kept(3))
    store.check_round(3)
    store.check_round(4)
    with pytest.raises(ValueError, match="round 2 goes back: this run's site state is already at round 3"):
        store.check_round(2)
