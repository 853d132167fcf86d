"""What a command prints: data on stdout, talk on stderr.

* stdout: the ``--json`` object (exactly one), else the data a command produces: the unified
  diff of ``--dry-run``, the ``list`` table (cli.py);
* stderr: the header naming the target, notes, the status table (long reasons wrapped to the
  terminal width; the JSON carries them whole), warnings, the next step, ``changed:`` or ``error:``.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

from ddtree_patcher.engine import Result

_COLORS = {"applied": "32", "upstream": "36", "not-applicable": "2", "pending": "33",
           "drifted": "31", "unsupported": "31", "lost": "31"}


def _color(text: str, status: str, enabled: bool) -> str:
    code = _COLORS.get(status)
    return f"\x1b[{code}m{text}\x1b[0m" if enabled and code else text


def width() -> int | None:
    """Columns to wrap stderr text to: $COLUMNS, else the terminal's; None (no wrapping) when
    stderr is not a terminal and COLUMNS is unset (logs keep one line per row)."""
    try:
        cols = int(os.environ.get("COLUMNS", ""))
        return cols if cols > 0 else None
    except ValueError:
        pass
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns if sys.stderr.isatty() else None
    except (OSError, ValueError, AttributeError):
        return None


def _wrap(text: str, indent: int, cols: int | None) -> str:
    if cols is None or cols - indent < 30:
        return text
    lines = textwrap.wrap(text, cols - indent, break_on_hyphens=False, break_long_words=False) or [""]
    return ("\n" + " " * indent).join(lines)


def header(command: str, target) -> None:
    print(f"ddtree-patch {command}: {target.describe()}", file=sys.stderr)


def table(result: Result, verbose: bool = True, cols: int | None = None) -> str:
    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    rows = [(r.patch.id, r.status, r.reason) for r in result.reports]
    w = max([len("PATCH")] + [len(r[0]) for r in rows])
    out = [f"{'PATCH':<{w}}  {'STATUS':<14}  REASON"]
    for report in result.reports:
        st = report.status
        out.append(f"{report.patch.id:<{w}}  {_color(f'{st:<14}', st, color)}  "
                   f"{_wrap(report.reason, w + 18, cols)}")
        if verbose:
            for f in report.files:
                out.append(f"{'':<{w}}    {f.path}: {_color(f.status, f.status, color)}")
    return "\n".join(out)


def _say(prefix: str, text: str, cols: int | None) -> None:
    print(prefix + _wrap(text, len(prefix), cols), file=sys.stderr)


def emit(result: Result, as_json: bool, error: str | None = None) -> None:
    cols = width()
    for note in result.all_notes:
        _say("note: ", note, cols)
    if result.diff and not as_json:  # data: stdout (`apply --dry-run > x.diff`); with --json it is in the object
        sys.stdout.write(result.diff)
        sys.stdout.flush()
    print(table(result, cols=cols), file=sys.stderr)
    for warning in result.warnings:
        _say("warning: ", warning, cols)
    if error:
        _say("error: ", error, cols)
    else:
        print(f"changed: {'yes' if result.changed else 'no'}", file=sys.stderr)
    if result.next:
        _say("next: ", result.next, cols)
    if as_json:
        doc = result.as_json()
        if error:
            doc["error"] = error
        print(json.dumps(doc, indent=2))


def emit_error(command: str, code: int, message: str, target=None, as_json: bool = False) -> None:
    _say("error: ", message, width())
    if as_json:
        doc = {"schema": 1, "command": command, "vllm": target.as_json() if target is not None else None,
               "changed": False, "exit_code": code, "error": message, "patches": []}
        if target is not None and target.notes:
            doc["notes"] = list(target.notes)
        print(json.dumps(doc, indent=2))
