"""``ddtree-patch survey``: per patch and anchor, what a release's code has (docs/survey.md).

On the wheels the suite already downloads (``tests/vllm_wheels.py``, the same cache the command
uses: nothing is downloaded here): 0.34.0 (V2-only: the V1 runner is gone, DFlash's sliding window
upstream, the DDTree patches on its V2 runner) and 0.26.0 (every patch pending
or upstream on verified shapes); and a release whose code moved: the refusal of ``apply`` names the
command, and the survey says where the function and its anchor went.
"""

from __future__ import annotations

import base64
import hashlib

import pytest

import vllm_wheels
from ddtree_patcher.engine import series


def _survey(cli, *args):
    rc, doc, err = cli("survey", *args, "--json", env={"DDTREE_PATCH_CACHE": str(vllm_wheels.cache_root())})
    assert rc == 0, err
    ids = [a for i, a in enumerate(args) if i and args[i - 1] == "--patch"] or [p.id for p in series()]
    assert doc["command"] == "survey" and [p["id"] for p in doc["patches"]] == ids
    return {p["id"]: p for p in doc["patches"]}, doc


def _file(patch: dict, path: str) -> dict:
    return next(f for f in patch["files"] if f["path"] == path)


def _site(file: dict, variant: str, function: str) -> dict:
    var = next(v for v in file["variants"] if v["name"] == variant)
    return next(s for s in var["sites"] if s["function"] == function)


def test_survey_of_0_34_0(cli):
    vllm_wheels.extracted("0.34.0")  # the suite's cache: the command finds the release there
    patches, doc = _survey(cli, "--release", "0.34.0")
    assert doc["vllm"]["version"] == "0.34.0" and doc["apply"] == {"exit_code": 0, "refusals": []}
    assert {k: p["status"] for k, p in patches.items()} == {
        "dflash-layer-offset": "upstream", "dflash-prefix-cache-drop": "upstream",
        "dflash-sliding-window": "upstream", "tree-walk-hook": "pending",
        "ddtree-proposer": "pending", "ddtree-tree-step": "pending"}

    # the sliding-window guard is gone: 0.25-0.33's variant does not recognise the file, 0.34's does
    swa = _file(patches["dflash-sliding-window"], "vllm/model_executor/models/qwen3_dflash.py")
    assert swa["variant"] == "resolved-0.34"
    guard = _site(swa, "guard-0.25", "_resolve_layer_attention")
    assert guard["matched"] == 0 and guard["expect"] == 1 and guard["engine"] == "mismatch"
    assert _site(swa, "guard-0.25", "DFlashQwen3DecoderLayer.__init__")["matched"] == 1
    assert "vllm#47914" in patches["dflash-sliding-window"]["reason"]

    # the V1 runner's files are gone, and with them the classes the V1 sites live in
    v1 = _file(patches["ddtree-proposer"], "vllm/v1/spec_decode/llm_base_proposer.py")
    assert not v1["present"] and v1["status"] == "not-applicable" and v1["gone_with"]
    propose = _site(v1, "v1-0.24", "SpecDecodeBaseProposer.propose")
    assert propose["state"] in ("file missing", "moved") and propose["class_elsewhere"] == []

    # the hooks' V2 sites: 0.34.0's shapes (DDTree on its V2 runner)
    hook = _file(patches["tree-walk-hook"], "vllm/v1/worker/gpu/model_runner.py")
    assert hook["variant"] == "v2-0.24"
    sample = _site(hook, "v2-0.24", "GPUModelRunner.sample")
    assert (sample["matched"], sample["shape_verified"]) == (1, True)
    draft = _site(_file(patches["ddtree-proposer"], "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py"),
                  "v2-0.24", "DFlashSpeculator._generate_draft")
    assert (draft["matched"], draft["shape_verified"]) == (1, True)
    # the tree step's drafter-rows anchor of 0.26.0-0.32.0 left DFlashSpeculator.propose (from 0.33.0): the
    # survey says where it went, and the 0.33.0 variant's anchor is what matches
    dfl = _file(patches["ddtree-tree-step"], "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py")
    assert dfl["variant"] == "v2-dflash-0.33"
    propose_v2 = _site(dfl, "v2-dflash-0.26", "DFlashSpeculator.propose")
    assert propose_v2["matched"] == 0
    assert {(p["path"], p["function"]) for p in propose_v2["anchor_elsewhere"]} == {
        ("vllm/v1/worker/gpu/spec_decode/dflash/speculator.py", "DFlashSpeculator._store_hidden_states")}


def test_survey_of_0_26_0(cli):
    vllm_wheels.extracted("0.26.0")
    patches, doc = _survey(cli, "--release", "0.26.0")
    assert doc["apply"]["exit_code"] == 0
    assert {k: p["status"] for k, p in patches.items()} == {
        "dflash-layer-offset": "upstream", **{p.id: "pending" for p in series()[1:]}}
    for p in patches.values():  # every selected variant's sites are where it expects, on verified shapes
        for f in p["files"]:
            if f["status"] != "pending":
                continue
            var = next(v for v in f["variants"] if v["name"] == f["variant"])
            assert var["recognises"] and not var["untested"], (p["id"], f["path"])
            for s in var["sites"]:  # a site of a pending variant may be upstream or not applicable already
                assert s["state"] in ("matched", "upstream", "not applicable"), (p["id"], f["path"], s)
                assert s["state"] != "matched" or s["shape_verified"], (p["id"], f["path"], s)
            assert any(s["state"] == "matched" for s in var["sites"]), (p["id"], f["path"])


def _record_line(rel: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}"


def test_refusal_names_the_survey_and_it_finds_what_moved(make_site, cli):
    """A release whose resolver was renamed (its RECORD agrees: not a foreign edit): apply refuses,
    naming the survey; the survey finds the guard in the renamed function."""
    site = make_site("0.33.0")
    rel = "vllm/model_executor/models/qwen3_dflash.py"
    old = (site / rel).read_bytes()
    new = old.replace(b"def _resolve_layer_attention(", b"def _resolve_layer_attention_per_layer(", 1)
    assert new != old
    (site / rel).write_bytes(new)
    record = next(site.glob("*.dist-info")) / "RECORD"
    lines = [(_record_line(rel, new) if ln.startswith(rel + ",") else ln) for ln in record.read_text().splitlines()]
    record.write_text("\n".join(lines) + "\n")

    rc, doc, err = cli("apply", "--vllm-path", str(site), "--json")
    assert rc == 3, err
    assert "dflash-sliding-window: unsupported" in err and "`ddtree-patch survey --release 0.33.0`" in err

    patches, sdoc = _survey(cli, "--vllm-path", str(site), "--patch", "dflash-sliding-window")
    assert sdoc["apply"]["exit_code"] == 3
    guard = _site(_file(patches["dflash-sliding-window"], rel), "guard-0.25", "_resolve_layer_attention")
    assert guard["state"] == "moved"  # the function is gone, its anchor is in another one
    assert [(p["path"], p["function"]) for p in guard["anchor_elsewhere"]] == [
        (rel, "_resolve_layer_attention_per_layer")]


def test_release_must_be_a_release_number(cli):
    rc, doc, err = cli("survey", "--release", "0.34.0+local", "--json")
    assert rc == 2 and "not a release number" in err
    rc, doc, err = cli("survey", "--json")
    assert rc == 2 and "--release" in err
