"""``ddtree-patch apply | verify | revert | list``.

Exit codes: 0 desired state holds; 1 internal error; 2 usage; 3 refused, nothing changed;
4 environment error, nothing changed; 5 post-apply validation failed, rolled back;
6 verify: something pending or lost.

``--json``: exactly one JSON object on stdout for every outcome, usage errors (exit 2) included;
the human text goes to stderr. Schema 1 (keys are only added, never renamed or removed):

* always: ``schema`` (1), ``command`` (``apply``/``verify``/``revert``, or the command whose
  arguments click refused; null when there is none), ``vllm`` (``{"path", "version", "dist"}`` or null when not resolved),
  ``changed`` (a file was written), ``restart_required`` (this run changed vLLM's files: running
  vLLM processes still hold the old code), ``exit_code``, ``patches`` (``[{"id", "status",
  "reason", "files": [{"path", "status", "reason"}]}]``, empty when the run ended before a scan);
* when they apply: ``error`` (why the exit code is not 0; whole, never wrapped), ``notes``,
  ``warnings``, ``next`` (verify: what to do now, as prose for a person), ``next_argv`` (the
  first command of ``next`` as an argv to run as is: the running ddtree-patch, the same target
  as absolute paths, apply with the same ``--patch`` selection; absent when that first step is
  not a ddtree-patch command, e.g. reinstalling vLLM), ``last_change`` (verify, exit 0 with
  patches applied: when ddtree-patch last changed this vLLM, ISO 8601 UTC; a vLLM process
  started before then runs older code), ``diff`` (``--dry-run``).

``list --json`` is its own object (``schema``, ``command``, ``patches``: the registry), except
for a usage error. ``--help`` and ``--version`` print text. docs/fleet.md ("The --json object")
documents the same; ``report.JSON_SCHEMA`` lists the keys.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import traceback

import click

from ddtree_patcher import __version__
from ddtree_patcher.errors import DDTreeError, ExitCode

EPILOG = """\b
Exit codes:
  0  the desired state holds (re-running is a no-op, changed: false)
  1  internal error
  2  usage error
  3  refused, nothing changed (unknown code shape, foreign edits, modified since apply)
  4  environment error, nothing changed (not found, permission, read-only, lock timeout)
  5  validation failed (apply: rolled back; verify --import: modules do not import)
  6  verify: something is pending, or a patch was lost (vLLM reinstalled after apply)
"""

def _seconds(ctx, param, value):
    if value is not None and (not math.isfinite(value) or value < 0):
        raise click.BadParameter(f"{value!r} is not a number of seconds (a finite number >= 0)")
    return value


_target_options = [
    click.option("--vllm-path", default=None,  # a file is refused by target.py (exit 4, with --json)
                 help="The vllm package folder, or the site-packages that holds it."),
    click.option("--python", "python", default=None,
                 help="Ask this interpreter where its vLLM is (default: the one running ddtree-patch)."),
    click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout; human text on stderr."),
    click.option("--lock-timeout", type=float, default=60.0, show_default=True, callback=_seconds,
                 help="Seconds to wait for another ddtree-patch run on the same vLLM."),
]
_patch_option = click.option("--patch", "patch_ids", multiple=True, metavar="ID",
                             help="Only this patch (repeatable; default: every patch).")


def _wants_json(argv: list[str]) -> bool:
    return "--json" in (argv[:argv.index("--")] if "--" in argv else argv)


class _Main(click.Group):
    """The command group; with ``--json`` anywhere on the command line, a usage error (click's
    exit 2: a bad option value, an unknown option or command) still prints exactly one JSON
    object on stdout, after click's own message on stderr."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or not _wants_json(argv):
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        from ddtree_patcher import report

        name = next((a for a in argv if a in self.commands), None)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            exc.show()
            ctx = getattr(exc, "ctx", None)
            if ctx is not None and ctx.command is not self and ctx.command.name in self.commands:
                name = ctx.command.name
            report.emit_error(name, exc.exit_code, exc.format_message(), as_json=True, say=False)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            report.emit_error(name, 1, "interrupted (nothing was changed, or the next command "
                              "finishes or rolls back what was)", as_json=True, say=False)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _self_argv() -> list[str]:
    """How to run this ddtree-patch again: its console script, else this interpreter with -m."""
    if os.path.basename(sys.argv[0]) == "ddtree-patch" and os.path.isfile(sys.argv[0]):
        return [os.path.abspath(sys.argv[0])]
    return [sys.executable, "-m", "ddtree_patcher.cli"]


def _next_argv(result, engine, vllm_path, python, patch_ids) -> list[str] | None:
    """The first step of verify's ``next`` as an argv, when that step is a ddtree-patch command:
    ``revert --force`` for files modified since apply, else ``apply`` for pending or lost patches.
    The same decisions, in the same order, as the prose (Engine._next_step)."""
    from ddtree_patcher.patchlib import DRIFTED, LOST, PENDING

    if result.command != "verify" or not result.next:
        return None
    where = []
    if vllm_path:
        where += ["--vllm-path", os.path.abspath(vllm_path)]
    if python:
        where += ["--python", os.path.abspath(python) if os.sep in python else python]
    drifted = {f.path for r in result.reports for f in r.files if f.status == DRIFTED}
    if drifted & set(engine._state().files):
        return [*_self_argv(), "revert", "--force", *where]
    if drifted or any(r.problem for r in result.reports):
        return None  # a person first: reinstall vLLM, or fix the runtime
    if any(r.status in (PENDING, LOST) for r in result.reports):
        return [*_self_argv(), "apply", *where, *(f"--patch={p}" for p in patch_ids)]
    return None


def _last_change(result, engine) -> str | None:
    """verify, exit 0, something applied: when ddtree-patch last wrote this vLLM's state."""
    from ddtree_patcher import report
    from ddtree_patcher.patchlib import APPLIED

    if result.command != "verify" or int(result.code) != 0 or not any(
            r.status == APPLIED for r in result.reports):
        return None
    try:
        return report.iso_utc(os.stat(engine.store.state_path).st_mtime)
    except OSError:
        return None


def target_options(f):
    for opt in reversed(_target_options):
        f = opt(f)
    return f


def _run(command: str, as_json: bool, vllm_path, python, lock_timeout, fn, patch_ids=()) -> None:
    from ddtree_patcher import report
    from ddtree_patcher.engine import Engine, RefusedWith
    from ddtree_patcher.errors import describe
    from ddtree_patcher.target import resolve

    target = None
    how = "".join(f" {opt} {shlex.quote(val)}" for opt, val in (("--vllm-path", vllm_path), ("--python", python))
                  if val)
    try:
        target = resolve(vllm_path, python)
        report.header(command, target)
        engine = Engine(target, lock_timeout=lock_timeout, python=python, how=how)
        result = fn(engine)
        report.emit(result, as_json, next_argv=_next_argv(result, engine, vllm_path, python, patch_ids),
                    last_change=_last_change(result, engine))
        sys.exit(int(result.code))
    except RefusedWith as exc:
        report.emit(exc.result, as_json, error=exc.message)
        sys.exit(int(ExitCode.REFUSED))
    except DDTreeError as exc:
        report.emit_error(command, int(exc.code), exc.message, target, as_json)
        sys.exit(int(exc.code))
    except (SystemExit, KeyboardInterrupt):
        raise
    except OSError as exc:  # the file system said no (full, read-only, gone): an environment error
        report.emit_error(command, int(ExitCode.ENVIRONMENT), f"{describe(exc)} (while running {command}; "
                          "an interrupted change is recovered by the next command)", target, as_json)
        sys.exit(int(ExitCode.ENVIRONMENT))
    except Exception as exc:  # a bug: say so, with the traceback
        traceback.print_exc()
        report.emit_error(command, int(ExitCode.INTERNAL), f"internal error: {exc!r}", target, as_json)
        sys.exit(int(ExitCode.INTERNAL))


@click.group(cls=_Main, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddtree-patch")
def main() -> None:
    """Apply, verify and revert DFlash/DDTree patches to an installed vLLM."""


@main.command(epilog=EPILOG)
@target_options
@_patch_option
@click.option("--dry-run", is_flag=True, help="Print the unified diff on stdout (in the JSON with --json); write nothing.")
@click.option("--allow-untested", is_flag=True,
              help="Apply to a code shape no variant was verified on, if its anchors match exactly.")
@click.option("--import-check", is_flag=True,
              help="After writing, import the patched modules in the target interpreter; roll back on failure.")
def apply(vllm_path, python, as_json, lock_timeout, patch_ids, dry_run, allow_untested, import_check):
    """Apply patches (all or nothing)."""
    _run("apply", as_json, vllm_path, python, lock_timeout,
         lambda e: e.apply(patch_ids, dry_run=dry_run, allow_untested=allow_untested, import_check=import_check))


@main.command(epilog=EPILOG)
@target_options
@_patch_option
@click.option("--import", "import_check", is_flag=True,
              help="Also import the patched modules in a subprocess of the target interpreter.")
def verify(vllm_path, python, as_json, lock_timeout, patch_ids, import_check):
    """Report each patch's status without changing anything (never imports vLLM by default)."""
    _run("verify", as_json, vllm_path, python, lock_timeout, lambda e: e.verify(patch_ids, import_check=import_check),
         patch_ids)


@main.command(epilog=EPILOG)
@target_options
@_patch_option
@click.option("--force", is_flag=True, help="Also revert files modified since apply (their edits are lost).")
@click.option("--dry-run", is_flag=True, help="Print the unified diff on stdout (in the JSON with --json); write nothing.")
def revert(vllm_path, python, as_json, lock_timeout, patch_ids, force, dry_run):
    """Restore the original bytes of patched files."""
    _run("revert", as_json, vllm_path, python, lock_timeout,
         lambda e: e.revert(patch_ids, force=force, dry_run=dry_run))


@main.command(name="list", epilog=EPILOG)
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout.")
def list_(as_json):
    """List the known patches."""
    import json

    from ddtree_patcher.engine import series

    rows = []
    for p in series():
        verified = sorted({v for f in p.files for var in f.variants for v in var.verified_on},
                          key=lambda s: tuple(int(x) for x in s.split(".")))
        rows.append({"id": p.id, "kind": p.kind, "summary": p.summary, "upstream": list(p.upstream),
                     "files": [f.path for f in p.files], "verified_on": verified})
    if as_json:  # stdout holds exactly one JSON object
        print(json.dumps({"schema": 1, "command": "list", "patches": rows}, indent=2))
        return
    for r in rows:  # data: on stdout (`ddtree-patch list | grep ...`)
        print(f"{r['id']:<24} {r['kind']:<5} {r['summary']}  [{', '.join(r['upstream'])}]")


@main.command(epilog="\b\nExit codes:\n  0  report written\n  2  usage (not a release number, bad options)\n"
                     "  4  the wheel could not be fetched or the vLLM not found")
@click.option("--release", default=None, metavar="X.Y.Z",
              help="Fetch the official vllm wheel of this release (pip, cached) and survey it.")
@click.option("--vllm-path", default=None, help="Survey this installed vLLM instead (read only).")
@_patch_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def survey(release, vllm_path, patch_ids, as_json):
    """Report per patch and anchor what matched, moved or is missing in a release (docs/survey.md)."""
    from ddtree_patcher import survey as survey_mod

    sys.exit(survey_mod.run(release, vllm_path, patch_ids, as_json))


if __name__ == "__main__":  # pragma: no cover
    main()
