"""Issue 33: the DDTREE_PATCH_* variables are parsed in one place (``runtime.switches``), strictly:
switches are exactly 0 or 1, and the boot guard refuses anything else at start, by name. No vLLM,
no torch: the parsing and the guard's first check run before either is imported."""
from __future__ import annotations

import logging

import pytest

from ddtree_patcher.runtime import ddtree, guard, hook, switches
from ddtree_patcher.runtime.switches import DDTreeConfigError

SWITCHES = ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE", "DDTREE_PATCH_TREE_STREAM")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("DDTREE_PATCH_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("name", SWITCHES)
def test_switch_accepts_exactly_0_and_1(monkeypatch, name):
    default = name == "DDTREE_PATCH_TREE_STREAM"
    assert switches.switch(name) is default  # unset
    monkeypatch.setenv(name, "")
    assert switches.switch(name) is default  # empty
    monkeypatch.setenv(name, "0")
    assert switches.switch(name) is False
    monkeypatch.setenv(name, "1")
    assert switches.switch(name) is True


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["false", "False", "no", "off", "true", "yes", "on", " 1", "1 ", "2", "01", "-"])
def test_switch_refuses_anything_else_by_name(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(DDTreeConfigError, match=f"{name}={value!r} is not a switch value: expected 0 or 1"):
        switches.switch(name)
    with pytest.raises(DDTreeConfigError):
        switches.check_all()


def test_enable_false_no_longer_requests_ddtree(monkeypatch):
    """Before issue 33, ``DDTREE_PATCH_ENABLE=false`` made ``hook.requested()`` and
    ``ddtree.enabled()`` true (any value but "" and "0")."""
    monkeypatch.setenv("DDTREE_PATCH_ENABLE", "false")
    for fn in (hook.requested, ddtree.enabled, ddtree.mode_line):
        with pytest.raises(DDTreeConfigError, match="DDTREE_PATCH_ENABLE='false'"):
            fn()
    monkeypatch.setenv("DDTREE_PATCH_ENABLE", "0")
    monkeypatch.setenv("DDTREE_PATCH_CHAIN_AS_TREE", "off")
    with pytest.raises(DDTreeConfigError, match="DDTREE_PATCH_CHAIN_AS_TREE='off'"):
        hook.requested()


def test_boot_guard_refuses_a_bad_switch_at_start(monkeypatch):
    monkeypatch.setenv("DDTREE_PATCH_ENABLE", "yes")
    with pytest.raises(DDTreeConfigError, match="DDTREE_PATCH_ENABLE='yes'"):
        guard.register()


@pytest.mark.parametrize("value, ok", [("", "error"), ("error", "error"), ("warn", "warn"), ("WARN", None),
                                       ("ignore", None)])
def test_on_drift_values(monkeypatch, value, ok):
    monkeypatch.setenv("DDTREE_PATCH_ON_DRIFT", value)
    if ok is None:
        with pytest.raises(DDTreeConfigError, match="DDTREE_PATCH_ON_DRIFT"):
            switches.on_drift()
    else:
        assert switches.on_drift() == ok


@pytest.mark.parametrize("value, ok", [(None, 63), ("", 63), ("1", 1), ("128", 128), ("2047", 2047),
                                       ("0", None), ("-5", None), ("abc", None), ("2048", None), ("1.5", None)])
def test_budget_values(monkeypatch, value, ok):
    if value is not None:
        monkeypatch.setenv("DDTREE_PATCH_BUDGET", value)
    if ok is None:
        with pytest.raises(DDTreeConfigError, match="is not a node budget"):
            switches.budget_from_env()
        with pytest.raises(DDTreeConfigError):
            switches.check_all()
    else:
        assert switches.budget_from_env() == ok == ddtree.budget_from_env()


def test_unknown_names_are_logged_not_fatal(monkeypatch, caplog):
    monkeypatch.setenv("DDTREE_PATCH_BUGDET", "31")
    monkeypatch.setenv("DDTREE_PATCH_CACHE", "/tmp/x")  # the CLI's own: not unknown
    with caplog.at_level(logging.WARNING, logger="vllm.ddtree_patch"):
        switches.check_all()
    text = caplog.text
    assert "DDTREE_PATCH_BUGDET" in text and "DDTREE_PATCH_CACHE" not in text.split("known:")[0]
