"""What a command prints: data on stdout, talk on stderr.

* stdout: the ``--json`` object (exactly one, for every outcome: see :data:`JSON_SCHEMA`), else
  the data a command produces: the unified diff of ``--dry-run``, the ``list`` table (cli.py);
* stderr: the header naming the target, notes, the status table, warnings, ``changed:`` or
  ``error:``, ``restart:`` (running vLLM processes still hold the code they loaded), ``next:``
  (what to do now) with the command itself on a line of its own (``  $ ...``).

Widths: on a terminal (or with ``$COLUMNS``) no line is longer than the width, except a single
word longer than it (a path); the table has columns PATCH, STATUS, REASON, and each file of a
patch is a sub-row with its status in the STATUS column and its path in the REASON column. When
the width is unknown (a pipe, a log) the table takes a compact form wrapped to
:data:`PIPE_WIDTH`, and each message (note, warning, error, next) stays on one line, so that a
log line holds a whole message; the JSON carries every text whole.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
from datetime import datetime, timezone

from ddtree_patcher.engine import Result

PIPE_WIDTH = 100  # the compact table's width when the output is not a terminal and $COLUMNS is unset
_STATUS_W = 14  # len("not-applicable")
_REASON_MIN = 30  # a narrower REASON column than this: the compact form

# The --json object (schema 1; keys are only ever added within a schema, never renamed or
# removed). docs/fleet.md ("The --json object") explains each key; tests/engine/test_cli.py
# checks every outcome against this list.
JSON_SCHEMA = {
    "always": ("schema", "command", "vllm", "changed", "restart_required", "exit_code", "patches"),
    "optional": ("error", "notes", "warnings", "next", "next_argv", "last_change", "diff"),
}

_COLORS = {"applied": "32", "upstream": "36", "not-applicable": "2", "pending": "33",
           "drifted": "31", "unsupported": "31", "lost": "31"}


def _color(text: str, status: str, enabled: bool) -> str:
    code = _COLORS.get(status)
    return f"\x1b[{code}m{text}\x1b[0m" if enabled and code else text


def width() -> int | None:
    """Columns to wrap stderr text to: $COLUMNS, else the terminal's; None when stderr is not a
    terminal and COLUMNS is unset (a pipe or a log: the compact table, one line per message)."""
    try:
        cols = int(os.environ.get("COLUMNS", ""))
        return cols if cols > 0 else None
    except ValueError:
        pass
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns if sys.stderr.isatty() else None
    except (OSError, ValueError, AttributeError):
        return None


def _lines(text: str, room: int | None) -> list[str]:
    """``text`` wrapped to ``room`` columns at spaces; a word longer than that is cut after a
    ``/`` when it is a path (a piece still longer stays whole); whole when ``room`` is None."""
    if room is None:
        return [text]
    room = max(room, 1)
    out: list[str] = []
    cur = ""
    for word in text.split():
        if len(word) > room:
            pieces = _path_lines(word, room)
            if cur and len(cur) + 1 + len(pieces[0]) <= room:
                pieces[0] = cur + " " + pieces[0]
            elif cur:
                out.append(cur)
            out.extend(pieces[:-1])
            cur = pieces[-1]
        elif not cur:
            cur = word
        elif len(cur) + 1 + len(word) <= room:
            cur += " " + word
        else:
            out.append(cur)
            cur = word
    out.append(cur)
    return out


def _wrap(text: str, indent: int, cols: int | None) -> str:
    if cols is None or cols - indent < _REASON_MIN:
        return text
    return ("\n" + " " * indent).join(_lines(text, cols - indent))


def _path_lines(path: str, room: int) -> list[str]:
    """A path cut after a ``/`` so that each piece fits ``room`` (a piece longer stays whole)."""
    out: list[str] = []
    cur: str | None = None
    for part in path.split("/"):
        if cur is None:
            cur = part
        elif len(cur) + len(part) + 2 > room:  # cur + "/" + part, and the "/" that may end the line
            out.append(cur + "/")
            cur = part
        else:
            cur += "/" + part
    out.append(cur or "")
    return out


def header(command: str, target) -> None:
    print(f"ddtree-patch {command}: {target.describe()}", file=sys.stderr)


def table(result: Result, verbose: bool = True, cols: int | None = None) -> str:
    """The status table: columns when the width is known and leaves the REASON column room,
    else the compact form (each patch on a line, its reason below, wrapped to PIPE_WIDTH)."""
    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    w = max([len("PATCH")] + [len(r.patch.id) for r in result.reports])
    reason_col = w + 2 + _STATUS_W + 2
    out = []
    if cols is not None and cols - reason_col >= _REASON_MIN:
        room = cols - reason_col
        out.append(f"{'PATCH':<{w}}  {'STATUS':<{_STATUS_W}}  REASON")
        for report in result.reports:
            st = report.status
            out.append(f"{report.patch.id:<{w}}  {_color(f'{st:<{_STATUS_W}}', st, color)}  "
                       + ("\n" + " " * reason_col).join(_lines(report.reason, room)))
            if verbose:
                for f in report.files:
                    pieces = _path_lines(f.path, room)
                    out.append(f"{'':<{w}}  {_color(f'{f.status:<{_STATUS_W}}', f.status, color)}  {pieces[0]}")
                    out.extend(" " * reason_col + p for p in pieces[1:])
        return "\n".join(out)
    room = min(cols or PIPE_WIDTH, PIPE_WIDTH)
    for report in result.reports:
        st = report.status
        out.append(f"{report.patch.id:<{w}}  {_color(st, st, color)}")
        if report.reason:
            out.extend("    " + line for line in _lines(report.reason, room - 4))
        if verbose:
            for f in report.files:
                out.append(f"  {_color(f'{f.status:<{_STATUS_W}}', f.status, color)}  {f.path}")
    return "\n".join(out)


def _say(prefix: str, text: str, cols: int | None) -> None:
    print(prefix + _wrap(text, len(prefix), cols), file=sys.stderr)


def command_lines(argv: list[str], cols: int | None, indent: str = "  $ ") -> list[str]:
    """``argv`` as one shell command a person can copy: whole on one line when it fits (always
    when the width is unknown), else continued with `` \\`` (a shell reads it as one line)."""
    words = [shlex.quote(a) for a in argv]
    line = indent + " ".join(words)
    if cols is None or len(line) <= cols:
        return [line]
    cont = " " * (len(indent) + 2)
    out, cur = [], indent + words[0]
    for word in words[1:]:
        if len(cur) + 1 + len(word) + 2 > cols:  # + " \"
            out.append(cur + " \\")
            cur = cont + word
        else:
            cur += " " + word
    out.append(cur)
    return out


def restart_text(command: str, last_change: str | None = None) -> str:
    if command == "verify":
        return (f"a vLLM process started before {last_change.replace('T', ' ').replace('Z', ' UTC')} (the last "
                "change ddtree-patch made here) still runs the code it loaded then: restart it")
    loaded = "the patched code" if command == "apply" else "the original code"
    return (f"running vLLM processes still hold the code they loaded before this change: restart them "
            f"to load {loaded}")


def iso_utc(mtime: float) -> str:
    return datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def emit(result: Result, as_json: bool, error: str | None = None, *, next_argv: list[str] | None = None,
         last_change: str | None = None) -> None:
    """The human report on stderr and, with ``as_json``, the object on stdout. ``next_argv``: the
    first command of ``result.next`` as an argv; ``last_change``: when ddtree-patch last changed
    this vLLM (ISO 8601, UTC), given by verify when it exits 0 with patches applied."""
    cols = width()
    restart = bool(result.changed) and result.command in ("apply", "revert") and not error
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
    if restart:
        _say("restart: ", restart_text(result.command), cols)
    elif last_change and not error:
        _say("restart: ", restart_text("verify", last_change), cols)
    if result.next:
        _say("next: ", result.next, cols)
        if next_argv:
            print("\n".join(command_lines(next_argv, cols)), file=sys.stderr)
    if as_json:
        doc = result.as_json()
        doc["restart_required"] = restart
        if error:
            doc["error"] = error
        if next_argv:
            doc["next_argv"] = list(next_argv)
        if last_change:
            doc["last_change"] = last_change
        _print_json(doc)


def _print_json(doc: dict) -> None:
    order = JSON_SCHEMA["always"] + JSON_SCHEMA["optional"]
    doc = {k: doc[k] for k in order if k in doc} | {k: v for k, v in doc.items() if k not in order}
    print(json.dumps(doc, indent=2))
    sys.stdout.flush()


def emit_error(command: str | None, code: int, message: str, target=None, as_json: bool = False,
               say: bool = True) -> None:
    """A run that ended without a scan (or before it): ``error:`` on stderr (unless ``say`` is
    false: click already said it) and, with ``as_json``, the object with ``"error"``."""
    if say:
        _say("error: ", message, width())
    if as_json:
        doc = {"schema": 1, "command": command, "vllm": target.as_json() if target is not None else None,
               "changed": False, "restart_required": False, "exit_code": code, "error": message, "patches": []}
        if target is not None and target.notes:
            doc["notes"] = list(target.notes)
        _print_json(doc)
