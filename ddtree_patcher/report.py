"""Human output (stderr) and JSON output (stdout, one schema-versioned object)."""

from __future__ import annotations

import json
import os
import sys

from ddtree_patcher.engine import Result

_COLORS = {"applied": "32", "upstream": "36", "not-applicable": "2", "pending": "33",
           "drifted": "31", "unsupported": "31", "lost": "31"}


def _color(text: str, status: str, enabled: bool) -> str:
    code = _COLORS.get(status)
    return f"\x1b[{code}m{text}\x1b[0m" if enabled and code else text


def header(command: str, target) -> None:
    print(f"ddtree-patch {command}: {target.describe()}", file=sys.stderr)


def table(result: Result, verbose: bool = True) -> str:
    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    rows = [(r.patch.id, r.status, r.reason) for r in result.reports]
    width = max([len("PATCH")] + [len(r[0]) for r in rows])
    out = [f"{'PATCH':<{width}}  {'STATUS':<14}  REASON"]
    for report in result.reports:
        st = report.status
        out.append(f"{report.patch.id:<{width}}  {_color(f'{st:<14}', st, color)}  {report.reason}")
        if verbose:
            for f in report.files:
                out.append(f"{'':<{width}}    {f.path}: {_color(f.status, f.status, color)}")
    return "\n".join(out)


def emit(result: Result, as_json: bool, error: str | None = None) -> None:
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if result.diff:
        print(result.diff, file=sys.stderr, end="")
    print(table(result), file=sys.stderr)
    if error:
        print(f"error: {error}", file=sys.stderr)
    else:
        print(f"changed: {'yes' if result.changed else 'no'}", file=sys.stderr)
    if as_json:
        doc = result.as_json()
        if error:
            doc["error"] = error
        print(json.dumps(doc, indent=2))


def emit_error(command: str, code: int, message: str, target=None, as_json: bool = False) -> None:
    print(f"error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"schema": 1, "command": command,
                          "vllm": target.as_json() if target is not None else None,
                          "changed": False, "exit_code": code, "error": message, "patches": []}, indent=2))
