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
