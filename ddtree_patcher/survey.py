"""``ddtree-patch survey --release X.Y.Z``: what every patch's anchors find in a vLLM release.

The report an engineer needs to add a variant for a release the patches do not know yet (and the
one an operator is pointed to when ``apply`` refuses a new release). It fetches the official
``vllm`` wheel of the release with pip (once, into the wheel cache), and reports:

* per patch, the engine's own classification (what ``verify`` says on a pristine install) and
  what ``apply`` would do (exit 0, or refuse and why);
* per target file, whether it is present (or gone, optional, gone with the V1 runner), the variant
  the engine selects, and per variant whether it recognises the file;
* per site (function + anchor): the function's shape hash and whether a variant was verified on
  it; the unfixed anchor matched N times (expected M), the upstream marker, ``applies``; where a
  function or an anchor is not where the variant looks, where it went: the functions and files
  of the release that define that name, or where the anchor matches (searched in the same file
  and in the release's files that mention the anchor's identifiers).

It reads the release's files only; it never imports vLLM and never writes to a site.

The wheel cache is ``$DDTREE_PATCH_CACHE`` (default ``~/.cache/ddtree-patch``), laid out as the
test suite lays it out (``tests/vllm_wheels.py``): ``extract/vllm-<release>/`` holds the wheel's
``vllm/**/*.py`` and dist-info, each checked against RECORD's sha256, ``.complete`` written last.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from ddtree_patcher.errors import DDTreeError, EnvironmentProblem, ExitCode, survey_hint as hint  # noqa: F401 - hint: the refusals' command

DIST = "vllm"
MAX_PLACES = 8  # locations listed per "found elsewhere"
MAX_PARSED = 8  # files parsed per anchor search beyond the target file (only where it has none)


# ---- the wheel cache --------------------------------------------------------------------------
def cache_root() -> Path:
    return Path(os.environ.get("DDTREE_PATCH_CACHE", Path.home() / ".cache" / "ddtree-patch"))


@contextmanager
def _locked(name: str):
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def check_release(release: str) -> str:
    """``release`` if it names a public release (``0.34.0``, ``0.20.1.post1``...), else a usage error."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(release)
    except InvalidVersion:
        v = None
    if v is None or v.local or release.strip() != release:
        raise DDTreeError(f"--release {release!r}: not a release number (e.g. 0.34.0)", code=ExitCode.USAGE)
    return release


def fetch(release: str, progress=lambda line: None) -> Path:
    """``extract/vllm-<release>/`` of the cache: the official wheel's Python files and dist-info,
    each checked against RECORD (downloaded with pip once; the wheel itself is not kept)."""
    out = cache_root() / "extract" / f"{DIST}-{release}"
    if (out / ".complete").exists():
        return out
    with _locked(f"unpack-{DIST}-{release}"):
        if (out / ".complete").exists():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".download-{DIST}-{release}-", dir=cache_root()))
        try:
            progress(f"downloading the official {DIST}=={release} wheel with pip ...")
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", "--only-binary",
                 ":all:", f"{DIST}=={release}", "-d", str(tmp)], capture_output=True, text=True)
            wheels = sorted(tmp.glob(f"{DIST}-{release}-*.whl"))
            if proc.returncode != 0 or not wheels:
                tail = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise EnvironmentProblem(f"cannot fetch the official {DIST}=={release} wheel with pip: {tail}")
            _unpack(out, wheels[-1], release)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _unpack(out: Path, whl: Path, release: str) -> None:
    from ddtree_patcher.state import sha256
    from ddtree_patcher.target import read_record

    info = f"{DIST}-{release}.dist-info/"
    part = out.with_name(out.name + ".tmp")
    shutil.rmtree(part, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    with zipfile.ZipFile(whl) as zf:
        names = zf.namelist()
        if not any(n.startswith(info) for n in names):
            raise EnvironmentProblem(f"{whl.name}: no {info} in the wheel")
        names = [n for n in names if (n.startswith("vllm/") and n.endswith(".py")) or n.startswith(info)]
        zf.extractall(part, names)
    record = read_record(next(part.glob("*.dist-info")))
    for n in names:
        if n in record and sha256((part / n).read_bytes()) != record[n]:
            raise EnvironmentProblem(f"{whl.name}: {n} does not match its RECORD hash")
    (part / ".complete").write_text(whl.name)
    part.rename(out)


# ---- searching the release --------------------------------------------------------------------
_COMMON = {"self", "None", "True", "False", "raise", "return", "import", "from", "with", "else", "super",
           "class", "lambda", "print", "list", "dict", "tuple", "anchor", "matched", "expected", "without",
           "then", "only", "unless", "always", "runner", "every", "after", "before", "first", "value"}


class _Release:
    """The release's files, read once; libcst parses cached by path."""

    def __init__(self, site: Path):
        self.site = site
        self._texts: dict[str, str] | None = None
        self._parsed: dict[str, object] = {}

    def texts(self) -> dict[str, str]:
        if self._texts is None:
            self._texts = {}
            for f in sorted((self.site / "vllm").rglob("*.py")):
                try:
                    self._texts[f.relative_to(self.site).as_posix()] = f.read_text(errors="replace")
                except OSError:
                    pass
        return self._texts

    def parse(self, rel: str):
        if rel not in self._parsed:
            import libcst as cst

            try:
                self._parsed[rel] = cst.parse_module(self.texts()[rel])
            except Exception:  # a file libcst cannot parse is simply not searched
                self._parsed[rel] = None
        return self._parsed[rel]

    def defs_named(self, qualname: str) -> list[dict]:
        """Where the release defines ``qualname``'s last part (its class too, for methods):
        ``[{path, function, line}]`` (the enclosing class found by indentation)."""
        parts = qualname.split(".")
        name = parts[-1]
        owner = parts[-2] if len(parts) > 1 else None
        kind = "class" if name[:1].isupper() and owner is None else "def"
        pattern = re.compile(rf"^(\s*)(?:async\s+)?{kind}\s+{re.escape(name)}\b", re.M)
        places = []
        for rel, text in self.texts().items():
            if f"{kind} {name}" not in text:
                continue
            for mt in pattern.finditer(text):
                line = text.count("\n", 0, mt.start()) + 1
                cls = _enclosing_class(text, mt.start(), len(mt.group(1)))
                if owner is not None and name in ("__init__", "forward", "__call__") and cls != owner:
                    continue  # a generic method name: only the same class counts
                places.append({"path": rel, "function": f"{cls}.{name}" if cls else name, "line": line})
        if owner is not None and any(p["function"] == f"{owner}.{name}" for p in places):
            return [p for p in places if p["function"] == f"{owner}.{name}"][:MAX_PLACES]
        return places[:MAX_PLACES]

    def class_places(self, qualname: str) -> list[dict]:
        """Where the release defines the class that owns method ``qualname`` (empty for a function)."""
        parts = qualname.split(".")
        if len(parts) < 2:
            return []
        return self.defs_named(parts[-2]) if parts[-2][:1].isupper() else []

    def anchor_places(self, site, rel: str | None, skip: str | None) -> list[dict]:
        """Functions of the release where ``site.unfixed`` matches: first in ``rel`` (the target file),
        then in files that mention the anchor's identifiers. ``skip``: the function already counted."""

        tokens = sorted({t for seg in re.findall(r"`([^`]+)`", site.anchor)
                         for t in re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", seg)} - _COMMON, key=len, reverse=True)
        matcher = site.unfixed()
        places = self._places([rel] if rel in self.texts() else [], matcher, rel, skip)
        if not places and tokens and rel:
            # the package the file lives in (two folders up: vllm/v1/worker/gpu/... -> vllm/v1/worker/)
            near = os.path.dirname(os.path.dirname(rel)) + "/"
            want = tokens[:2]
            others = [f for f, text in self.texts().items()
                      if f != rel and f.startswith(near) and all(t in text for t in want)]
            others.sort(key=lambda f: len(self.texts()[f]))
            places = self._places(others[:MAX_PARSED], matcher, rel, skip)
        return places[:MAX_PLACES]

    def _places(self, files, matcher, rel, skip) -> list[dict]:
        from ddtree_patcher.cst_helpers import count

        places = []
        for f in files:
            module = self.parse(f)
            if module is None:
                continue
            for qual, node in _all_defs(module):
                if f == rel and qual == skip:
                    continue
                n = count(node, matcher)
                if n:
                    places.append({"path": f, "function": qual, "matches": n, "line": def_line(self.texts()[f], qual)})
        # innermost only: a method's matches are also its class's
        return [p for p in places if not any(q is not p and q["path"] == p["path"]
                                             and q["function"].startswith(p["function"] + ".") for q in places)]


def _enclosing_class(text: str, pos: int, indent: int) -> str | None:
    if indent == 0:
        return None
    for mt in reversed(list(re.finditer(r"^(\s*)class\s+(\w+)", text[:pos], re.M))):
        if len(mt.group(1)) < indent:
            return mt.group(2)
    return None


def _all_defs(module, prefix: str = ""):
    """(qualified name, node) of every function and class of the module, nested ones included."""
    import libcst as cst

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
                qual = f"{prefix}{node.name.value}"
                yield qual, node
                if isinstance(node.body, cst.IndentedBlock):
                    yield from walk(node.body.body, qual + ".")

    yield from walk(module.body, prefix)


def def_line(text: str, qualname: str) -> int | None:
    """The line of ``qualname``'s ``def``/``class`` in ``text`` (each part nested in the previous one)."""
    pos, indent = 0, -1
    for part in qualname.split("."):
        pattern = re.compile(rf"^([ \t]*)(?:async[ \t]+)?(?:def|class)[ \t]+{re.escape(part)}\b", re.M)
        for mt in pattern.finditer(text, pos):
            if len(mt.group(1)) > indent:
                pos, indent = mt.end(), len(mt.group(1))
                break
        else:
            return None
    return text.count("\n", 0, pos) + 1


# ---- the survey -------------------------------------------------------------------------------
def _site_report(patch, pf, variant, site, module, rel_present: bool, release: _Release, source: bytes | None):
    from ddtree_patcher import cst_helpers as h
    from ddtree_patcher.examine import site_state

    out = {"function": site.function, "anchor": site.anchor, "expect": site.expect}
    if not rel_present:
        out["state"] = "file missing"
        out["function_elsewhere"] = release.defs_named(site.function)
        out["class_elsewhere"] = release.class_places(site.function)
        if out["function_elsewhere"]:
            out["state"] = "moved"
        return out
    node = h.find_def(module, site.function)
    if node is None:
        out["state"] = "function missing"
        out["function_elsewhere"] = release.defs_named(site.function)
        out["class_elsewhere"] = release.class_places(site.function)
        out["anchor_elsewhere"] = release.anchor_places(site, pf.path, None)
        if out["function_elsewhere"] or out["anchor_elsewhere"]:
            out["state"] = "moved"
        return out
    shape = h.shape_hash(module, node)
    n = h.count(node, site.unfixed())
    fixed = h.count(node, site.fixed()) if site.fixed is not None else None
    applies = site.applies(module, node) if site.applies is not None else None
    st = site_state(patch, pf.path, module, site, source is None or patch.marker.encode() in source)
    out.update(line=def_line(module.code, site.function), shape=shape,
               shape_verified=shape in variant.shapes.get(site.function, frozenset()),
               matched=n, upstream_marker=fixed, applies=applies, engine=st.status, reason=st.reason)
    if st.status in ("pending", "upstream", "applied"):
        out["state"] = "matched" if st.status == "pending" else st.status
        if st.status == "pending" and not out["shape_verified"]:
            out["state"] = "matched, new shape"
    elif st.status == "not-applicable":
        out["state"] = "not applicable"
    else:
        out["state"] = "missing" if n == 0 else f"matched {n} times"
    if n != site.expect and not fixed and site.unfixed.__name__ != "never":
        out["anchor_elsewhere"] = release.anchor_places(site, pf.path, site.function)
        if n == 0 and out["anchor_elsewhere"] and st.status == "mismatch":
            here = any(p["path"] == pf.path for p in out["anchor_elsewhere"])
            out["state"] = "moved within the file" if here else "missing (matches elsewhere)"
    return out


def survey_site(site: Path, ids=None) -> dict:
    """The survey of the vLLM at ``site`` (a folder holding ``vllm/`` and its dist-info)."""
    from ddtree_patcher import engine
    from ddtree_patcher.examine import examine
    from ddtree_patcher.patchlib import PENDING, UNSUPPORTED, DRIFTED
    from ddtree_patcher.state import State
    from ddtree_patcher.target import from_site

    target = from_site(site)
    patches = engine.select(ids)
    src = engine.Sources(target)
    reports = engine.scan_target(target, State(), patches, src)
    release = _Release(site)
    doc_patches = []
    refusals = []
    for report in reports:
        patch = report.patch
        missing = [r for r in patch.requires if not (site / r).exists()]
        files = []
        for fr, pf in zip(report.files, patch.files):
            data = src.read(pf.path)
            entry = {"path": pf.path, "status": fr.status, "reason": fr.reason, "present": data is not None}
            if pf.optional:
                entry["optional"] = True
            if pf.gone_with:
                entry["gone_with"] = list(pf.gone_with)
            if missing:
                entry["requires_missing"] = missing
                files.append(entry)
                continue
            module = src.parse(data, pf.path) if data is not None else None
            if module is not None:
                entry["variant"] = examine(patch, pf, module, data).variant
            variants = []
            for variant in pf.variants:
                one = examine(patch, dataclasses.replace(pf, variants=(variant,)), module, data) if module else None
                variants.append({
                    "name": variant.name, "verified_on": list(variant.verified_on),
                    "recognises": bool(one and one.status != UNSUPPORTED),
                    "status": one.status if one else None,
                    "untested": bool(one and one.untested),
                    "sites": [_site_report(patch, pf, variant, s, module, module is not None, release, data)
                              for s in variant.sites]})
            entry["variants"] = variants
            files.append(entry)
        status = report.status
        if status in (UNSUPPORTED, DRIFTED):
            refusals.append(f"{patch.id}: {status}")
        elif status == PENDING and any(f.untested for f in report.files):
            refusals.append(f"{patch.id}: pending on a shape no variant was verified on (--allow-untested)")
        doc_patches.append({"id": patch.id, "status": status, "reason": report.reason, "files": files})
    return {"schema": 1, "command": "survey", "vllm": {"version": target.version, "dist": target.dist,
                                                     "path": str(site)},
            "apply": {"exit_code": int(ExitCode.REFUSED) if refusals else 0, "refusals": refusals},
            "patches": doc_patches}


# ---- rendering --------------------------------------------------------------------------------
def _where(places: list[dict], key: str = "") -> str:
    return ", ".join(f"{p['path']}:{p.get('line') or '?'} {p['function']}"
                     + (f" ({p['matches']}x)" if key and p.get("matches") else "") for p in places)


def render(doc: dict) -> str:
    v = doc["vllm"]
    lines = [f"ddtree-patch survey: vLLM {v['version']} [{v['dist']}] at {v['path']}"]
    a = doc["apply"]
    lines.append("apply on this release: " + ("exit 0 (nothing refused)" if not a["exit_code"]
                                              else f"refused (exit 3): {'; '.join(a['refusals'])}"))
    for p in doc["patches"]:
        lines += ["", f"{p['id']}: {p['status']}", f"    {p['reason']}"]
        for f in p["files"]:
            gone = f" (gone with {', '.join(f['gone_with'])})" if f.get("gone_with") else ""
            head = f"  {f['path']}: {f['status']}"
            if not f["present"]:
                head += f" -- file absent{gone}{' (optional)' if f.get('optional') else ''}"
            elif f.get("variant"):
                head += f" (variant {f['variant']})"
            lines.append(head)
            if f.get("requires_missing"):
                lines.append(f"      requires {', '.join(f['requires_missing'])}: absent (the feature is not in this release)")
                continue
            for var in f.get("variants", []):
                verdict = (f"recognises the file: {var['status']}" + (" (untested shape)" if var["untested"] else "")
                           if var["recognises"] else "does not recognise the file")
                lines.append(f"    variant {var['name']} (verified on {_span(var['verified_on'])}): {verdict}")
                for s in var["sites"]:
                    lines.append("      " + _site_line(s))
                    if "class_elsewhere" in s:
                        owner = s["function"].split(".")[-2] if "." in s["function"] else None
                        if owner:
                            lines.append(f"          class {owner}: " + (_where(s["class_elsewhere"]) or
                                                                         "defined nowhere in this release"))
                    if "function_elsewhere" in s:
                        lines.append("          a def of that name: " + (_where(s["function_elsewhere"]) or
                                                                        "nowhere in this release"))
                    if "anchor_elsewhere" in s:
                        lines.append("          anchor found at: " + (_where(s["anchor_elsewhere"], "m") or
                                                             "nowhere (searched: this file, then its package)"))
    return "\n".join(lines) + "\n"


def _site_line(s: dict) -> str:
    where = f"{s['function']}"
    if s.get("line"):
        where += f" (line {s['line']})"
    if "shape" not in s:
        return f"{where}: {s['state'].upper()}: anchor {s['anchor']}"
    shape = f"shape {s['shape']} {'verified' if s['shape_verified'] else 'new'}"
    bits = [f"anchor matched {s['matched']}x (expected {s['expect']})"]
    if s.get("upstream_marker"):
        bits.append(f"upstream marker {s['upstream_marker']}x")
    if s.get("applies") is not None:
        bits.append(f"applies={s['applies']}")
    return f"{where}: {s['state'].upper()}: {shape}; {', '.join(bits)}: {s['anchor']}"


def _span(versions: list[str]) -> str:
    versions = sorted(versions, key=lambda v: tuple(int(x) for x in re.findall(r"\d+", v)))
    return f"{versions[0]}-{versions[-1]}" if len(versions) > 2 else ", ".join(versions) or "-"


def run(release: str | None, vllm_path: str | None, ids, as_json: bool) -> int:
    """The ``survey`` command: the report on stdout (JSON with ``as_json``), progress on stderr."""
    say = lambda line: print(f"ddtree-patch survey: {line}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        if (release is None) == (vllm_path is None):
            raise DDTreeError("survey takes --release X.Y.Z (fetches the official wheel) or --vllm-path",
                              code=ExitCode.USAGE)
        if release is not None:
            site = fetch(check_release(release), say)
        else:
            from ddtree_patcher.target import resolve

            site = resolve(vllm_path, None).site
        doc = survey_site(site, ids)
    except DDTreeError as exc:
        print(json.dumps({"schema": 1, "command": "survey", "exit_code": int(exc.code), "error": exc.message})
              if as_json else "", end="\n" if as_json else "")
        print(f"error: {exc.message}", file=sys.stderr)
        return int(exc.code)
    except OSError as exc:
        from ddtree_patcher.errors import describe

        print(f"error: {describe(exc)}", file=sys.stderr)
        return int(ExitCode.ENVIRONMENT)
    print(json.dumps(doc, indent=2) if as_json else render(doc), end="\n" if as_json else "")
    return 0
