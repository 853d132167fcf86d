"""Exit codes and the errors that carry them.

Every command ends with exactly one of these codes (documented in README.md and ``--help``):

0  the desired state holds (re-running is a no-op, ``changed: false``)
1  internal error (a bug in ddtree-patch)
2  usage error (click's own code)
3  refused, nothing changed: unknown code shape, foreign edits, modified since apply, bad state
4  environment error, nothing changed: vLLM not found or ambiguous, permission, read-only, lock timeout
5  post-apply validation failed; every file was rolled back
6  ``verify``: something is pending, or a recorded patch was lost (vLLM reinstalled after apply)
"""

from __future__ import annotations

import enum
import errno


class ExitCode(enum.IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2
    REFUSED = 3
    ENVIRONMENT = 4
    VALIDATION = 5
    NOT_APPLIED = 6


class DDTreeError(Exception):
    """An error with a stable exit code and a message meant for an operator."""

    code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, code: ExitCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])


class Refused(DDTreeError):
    code = ExitCode.REFUSED


class EnvironmentProblem(DDTreeError):
    code = ExitCode.ENVIRONMENT


class ValidationFailed(DDTreeError):
    code = ExitCode.VALIDATION


# What an operator should read for an OSError, and what to do about it.
_ADVICE = {
    errno.EROFS: ("read-only file system", "patch at image-build time, or where site-packages is writable"),
    errno.EACCES: ("permission denied", "run as the owner of site-packages, or patch at image-build time"),
    errno.EPERM: ("operation not permitted", "run as the owner of site-packages, or patch at image-build time"),
    errno.ENOSPC: ("no space left on device", "free some space and run the command again"),
    errno.EDQUOT: ("disk quota exceeded", "free some space and run the command again"),
    errno.ENAMETOOLONG: ("file name too long", "the path is too long for this file system; use a shorter one"),
    errno.EEXIST: ("file exists", "something else created that name; remove it if it is not yours"),
}


def is_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def describe(exc: OSError, name: bool = True) -> str:
    """``<file>: <plain reason>`` for an OSError (without the file name when ``name`` is false)."""
    what, _ = _ADVICE.get(exc.errno, (exc.strerror or str(exc), ""))
    return f"{exc.filename}: {what}" if name and exc.filename else what


def advice(exc: OSError) -> str:
    return _ADVICE.get(exc.errno, ("", ""))[1]


def environment(exc: OSError, doing: str, changed: str = "nothing was changed",
                name: bool = True) -> EnvironmentProblem:
    """An exit-4 error for ``exc`` raised while ``doing`` something: what, why, and what to do."""
    tip = advice(exc)
    return EnvironmentProblem(f"{doing}: {describe(exc, name)}; {changed}" + (f". To fix: {tip}" if tip else ""))


def survey_hint(version: str | None) -> str:
    """The command named in refusals of code the variants do not know."""
    from packaging.version import InvalidVersion, Version

    try:
        ok = version is not None and not Version(version).local and not Version(version).is_devrelease
    except InvalidVersion:
        ok = False
    return (f"`ddtree-patch survey --release {version if ok else '<X.Y.Z>'}` reports, per patch and anchor, "
            "what matched, what moved and what is missing in this release")
