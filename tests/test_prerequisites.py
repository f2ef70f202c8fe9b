"""A missing prerequisite skips a test on a user's machine, with the reason, and fails it in CI."""

import pytest

from tests.prerequisites import in_ci, require, require_tools


@pytest.mark.parametrize("value", ["", "0", "false", "No"])
def test_ci_is_off_unless_set_to_something_true(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert not in_ci()
    monkeypatch.setenv("CI", "true")
    assert in_ci()


def test_a_missing_prerequisite_skips_with_its_reason_for_a_user(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    require(True, "a Docker engine", "start Docker")  # present: nothing happens
    with pytest.raises(pytest.skip.Exception, match=r"needs a Docker engine \(start Docker\)"):
        require(False, "a Docker engine", "start Docker")


def test_a_missing_prerequisite_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="needs a Docker engine .*make provision"):
        require(False, "a Docker engine", "start Docker")


def test_missing_commands_are_named(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    require_tools("sh")
    with pytest.raises(pytest.skip.Exception, match="needs no-such-tool-1 and no-such-tool-2"):
        require_tools("sh", "no-such-tool-1", "no-such-tool-2")
