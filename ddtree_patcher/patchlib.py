"""The patch model: a patch is data plus small libcst transformers.

A :class:`Patch` names the files it rewrites. For each file it lists *variants*, each keyed
by the code shape it recognises (the ``cst`` shape hash of every function it touches,
``cst_helpers.shape_hash``, docs/design.md "Selection by shape") and by its anchors: a matcher for the unfixed code, a matcher for the
upstream fix, and the transformer that rewrites the anchor. The version of vLLM is never
consulted: selection is by shape. The engine (``ddtree_patcher.engine``) knows nothing about
any particular patch.

Per-file findings, in the order they are decided:

* ``applied``        every site of a variant carries this patch's marker comment;
* ``upstream``       the upstream fix's marker matches (and nothing is left to do);
* ``not-applicable`` the code the patch targets does not exist in this release;
* ``pending``        every unfixed anchor matches exactly as often as expected;
* ``unsupported``    no variant recognises the file: the reason names file, function, anchor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import importlib
import re
from typing import Any, Callable, Mapping

APPLIED = "applied"
PENDING = "pending"
UPSTREAM = "upstream"
NOT_APPLICABLE = "not-applicable"
DRIFTED = "drifted"
UNSUPPORTED = "unsupported"
LOST = "lost"
STATUSES = (APPLIED, PENDING, UPSTREAM, NOT_APPLICABLE, DRIFTED, UNSUPPORTED, LOST)


class _Lazy:
    """A module imported on first use: libcst (and its matchers, ~0.7 s to import) is only
    needed when a file must be parsed, not for hash-only checks such as ``verify``."""

    def __init__(self, name: str):
        self._name = name
        self._module = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


cst = _Lazy("libcst")
m = _Lazy("libcst.matchers")

# Where DFlash exists at all (0.20.0+; the drafter model file): a patch's usual ``requires``.
DFLASH_MODEL = "vllm/model_executor/models/qwen3_dflash.py"
# The V1 runner's DFlash files, gone together from vLLM 0.34.0 (V2-only): a V1-only target file's
# ``gone_with``, so that it is not applicable where both are missing (and refused where only it is).
V1_DFLASH = ("vllm/v1/spec_decode/dflash.py", "vllm/v1/worker/gpu_model_runner.py")

Matcher = Callable[[], Any]  # a function returning a libcst matcher (built lazily, see _Lazy)


@dataclass(frozen=True)
class Site:
    """One rewrite inside one function of a target file."""

    function: str  # qualified name inside the file: "Class.method" or "function"
    anchor: str  # the unfixed anchor, in words (used in refusals)
    unfixed: Matcher  # counted inside the function; must match ``expect`` times
    rewrite: Callable[[str], Any]  # patch id -> a CountingTransformer (see examine.py)
    fixed: Matcher | None = None  # upstream's fix; a match means "upstream"
    # False when the code the patch targets is absent from this function (e.g. no DFlash branch).
    applies: Callable[[Any, Any], bool] | None = None  # (module, function node) -> bool
    expect: int = 1
    fixed_by: str = ""  # the upstream change ``fixed`` recognises, named in the "upstream" reason
    absent: str = ""  # why the site is not applicable where ``applies`` says so (default: code absent)


@dataclass(frozen=True)
class Variant:
    name: str
    verified_on: tuple[str, ...]  # releases the variant was verified on (a hint, never a selector)
    sites: tuple[Site, ...]
    # qualified function name -> the pristine shape hashes this variant was verified on
    shapes: Mapping[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class PatchFile:
    path: str  # relative to the directory that holds the ``vllm`` package, e.g. "vllm/v1/..."
    variants: tuple[Variant, ...]
    # the file may be missing from a release (then: not-applicable); otherwise missing = unsupported
    optional: bool = False
    # the file may be missing where every one of these files is missing too (its code went with them,
    # e.g. the V1 runner's DFlash files in a V2-only vLLM): then not-applicable; else as ``optional`` says
    gone_with: tuple[str, ...] = ()


@dataclass(frozen=True)
class Patch:
    id: str
    summary: str
    kind: str  # "fix" | "hook"
    upstream: tuple[str, ...]  # upstream references ("vllm-project/vllm#40727")
    files: tuple[PatchFile, ...]
    # files whose absence means the patched feature does not exist in this release at all
    requires: tuple[str, ...] = ()
    doc: str = ""
    # For hooks: (site, target interpreter or None) -> a problem with the runtime the patched code
    # imports (missing, incompatible), or None. ``verify`` reports a problem as drifted (exit 3).
    runtime: Callable[[Any, str | None], str | None] | None = None

    @property
    def marker(self) -> str:
        return f"# ddtree-patch: {self.id}"


@dataclass(frozen=True)
class Finding:
    status: str
    reason: str
    variant: str | None = None
    untested: bool = False  # pending on a shape no variant was verified on (anchors still match)
    pending_sites: tuple[Site, ...] = ()




def replace_and_mark(matcher: Matcher, replace: Callable[[Any], Any]) -> Callable[[str], Any]:
    """A ``Site.rewrite`` for the common case: replace every node matching ``matcher()`` with
    ``replace(node)`` and put the patch's marker comment at the end of each changed line."""

    def make(patch_id: str):
        from ddtree_patcher.rewriters import ReplaceAndMark

        return ReplaceAndMark(patch_id, matcher(), replace)

    return make


def rules_rewrite(*rules) -> Callable[[str], Any]:
    """A ``Site.rewrite``: ``rules`` are (matcher function, action(node) -> node) pairs; every
    node matching a rule is rewritten by its action (which marks the changed lines) and counted."""

    def make(patch_id: str):
        from ddtree_patcher.rewriters import CountingTransformer

        class RulesTransformer(CountingTransformer):
            def __init__(self):
                super().__init__(patch_id)
                self.rules = [(matcher(), action) for matcher, action in rules]

            def on_leave(self, original_node, updated_node):
                for matcher, action in self.rules:
                    if m.matches(original_node, matcher):
                        self.matches += 1
                        return action(updated_node)
                return updated_node

        return RulesTransformer()

    return make


def insert_statements(matcher: Matcher, code: str, *, after: bool) -> Callable[[str], Any]:
    """A ``Site.rewrite``: ``code`` (statements already carrying the marker) right after, or right
    before, every statement matching ``matcher()`` (before: its comment lines stay with it)."""

    def insert(node):
        body = list(cst.parse_module(code).body)
        return cst.FlattenSentinel([node, *body] if after else [*body, node])

    return rules_rewrite((matcher, insert))


def any_of(*matchers: Matcher) -> Matcher:
    return lambda: m.OneOf(*(f() for f in matchers))


def never():
    """An anchor that matches nothing (see :func:`absent_site`)."""
    return m.Name("__ddtree_patch_never__")


def absent_site(function: str, anchor: str, present: str) -> Site:
    """The only site of a variant for releases that lack ``present`` (a qualified name): there the
    file is not applicable; where ``present`` exists this variant never matches, so another
    variant must recognise the file (or it is refused) — never a silent skip."""

    def has(module, node) -> bool:
        from ddtree_patcher.cst_helpers import find_def

        return find_def(module, present) is not None

    return Site(function=function, anchor=anchor, unfixed=never, rewrite=rules_rewrite(), applies=has)


def unported_site(function: str, shapes: frozenset[str], why: str) -> Site:
    """The only site of a variant for a code shape the patch's runtime is known not to support yet:
    where ``function`` has one of ``shapes`` (pristine ``cst`` hashes) the file is not applicable,
    ``why`` being the reason; anywhere else this variant never matches, so another variant must
    recognise the file (or it is refused). A new shape is never silently skipped."""

    def unknown(module, node) -> bool:
        from ddtree_patcher.cst_helpers import shape_hash

        return shape_hash(module, node) not in shapes

    return Site(function=function, anchor=f"`{function}` of a shape known to be unsupported ({', '.join(sorted(shapes))})",
                unfixed=never, rewrite=rules_rewrite(), applies=unknown, absent=why)


def runtime_abi(module: str, attr: str, python: str | None) -> tuple[int | None, str]:
    """``(ABI, where)``: ``module.attr``, the ABI a runtime module of ours speaks in vLLM's
    interpreter (``python``, else this one). When ``python`` cannot import the module:
    ``(None, its last error line)``."""
    if python is None:
        return getattr(importlib.import_module(module), attr), "this interpreter"
    import subprocess

    proc = subprocess.run([python, "-c", f"import {module} as m; print(m.{attr})"],
                          capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["?"])[-1]
    return int(proc.stdout.strip()), python


def runtime_check(module: str, attr: str, label: str, files: tuple[str, ...],
                  written: bytes) -> Callable[[Any, str | None], str | None]:
    """A ``Patch.runtime`` for call sites that write their ABI into the files: ``written`` (a regex
    with one group) finds it in ``files`` (paths under the site, missing ones skipped);
    ``module.attr`` must import in vLLM's interpreter (``python``, else this one) and, where the
    files carry an ABI, speak it."""
    pattern = re.compile(written)

    def check(site, python: str | None) -> str | None:
        found = set()
        for rel in files:
            try:
                found |= {int(a) for a in pattern.findall((site / rel).read_bytes())}
            except FileNotFoundError:
                pass
        abi, where = runtime_abi(module, attr, python)
        if abi is None:
            return (f"{python} cannot import {module} ({where}): the patched vLLM would fail when DDTree is "
                    "requested; install ddtree-patch in that environment or `ddtree-patch revert`")
        if found and found != {abi}:
            return (f"the call sites speak {label} ABI {sorted(found)} but {module} in {where} speaks {abi}: "
                    "run `ddtree-patch revert && ddtree-patch apply` with the installed ddtree-patch")
        return None

    return check
