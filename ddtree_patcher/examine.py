"""Classify and rewrite parsed files for a patch (the libcst half of the patch model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import libcst as cst
import libcst.matchers as m

from ddtree_patcher import cst_helpers as h
from ddtree_patcher.patchlib import (
    APPLIED, DRIFTED, NOT_APPLICABLE, PENDING, UNSUPPORTED, UPSTREAM, Finding, Patch, PatchFile, Site,
)


class CountingTransformer(cst.CSTTransformer):
    """Base for site transformers: count every rewrite in ``self.matches``."""

    def __init__(self, patch_id: str):
        super().__init__()
        self.patch_id = patch_id
        self.matches = 0


@dataclass(frozen=True)
class _SiteState:
    status: str  # applied | upstream | not-applicable | pending | mismatch
    reason: str
    node: cst.CSTNode | None = None


def _site_state(patch: Patch, path: str, module: cst.Module, site: Site, marked: bool) -> _SiteState:
    where = f"{path}: {site.function}"
    node = h.find_def(module, site.function)
    if node is None:
        return _SiteState("mismatch", f"{where}: function not found (anchor: {site.anchor})")
    if marked and h.contains_text(module, node, patch.marker):
        return _SiteState(APPLIED, f"{where}: carries '{patch.marker}'", node)
    if site.fixed is not None and h.count(node, site.fixed()):
        by = f" ({site.fixed_by})" if site.fixed_by else ""
        return _SiteState(UPSTREAM, f"{where}: upstream fix present{by}", node)
    if site.applies is not None and not site.applies(module, node):
        return _SiteState(NOT_APPLICABLE, f"{where}: {site.absent or 'targeted code absent in this release'}", node)
    n = h.count(node, site.unfixed())
    if n != site.expect:
        return _SiteState(
            "mismatch", f"{where}: anchor {site.anchor} matched {n} times (expected {site.expect})", node
        )
    return _SiteState(PENDING, f"{where}: {site.anchor}", node)


def examine(patch: Patch, pfile: PatchFile, module: cst.Module, source: bytes | None = None) -> Finding:
    """Classify one parsed file for one patch (pure: reads the tree only).

    ``source``, the bytes the module was parsed from, lets a file without this patch's marker
    skip the per-function marker search."""
    marked = source is None or patch.marker.encode() in source
    mismatches: list[str] = []
    candidates: list[Finding] = []
    for variant in pfile.variants:
        states = [_site_state(patch, pfile.path, module, s, marked) for s in variant.sites]
        bad = [s.reason for s in states if s.status == "mismatch"]
        if bad:
            mismatches.append(f"variant {variant.name}: " + "; ".join(bad))
            continue
        kinds = {s.status for s in states}
        if APPLIED in kinds and PENDING in kinds:
            candidates.append(Finding(DRIFTED, "partially applied: " + "; ".join(
                s.reason for s in states if s.status == PENDING), variant.name))
        elif APPLIED in kinds:
            candidates.append(Finding(APPLIED, "; ".join(s.reason for s in states if s.status == APPLIED),
                                      variant.name))
        elif PENDING in kinds:
            pending = tuple(site for site, st in zip(variant.sites, states) if st.status == PENDING)
            untested = any(
                h.shape_hash(module, st.node) not in variant.shapes.get(site.function, frozenset())
                for site, st in zip(variant.sites, states) if st.status == PENDING
            )
            reason = "; ".join(s.reason for s in states if s.status == PENDING)
            if untested:
                reason += f" (untested shape: not one variant {variant.name} was verified on)"
            candidates.append(Finding(PENDING, reason, variant.name, untested, pending))
        elif UPSTREAM in kinds:
            candidates.append(Finding(UPSTREAM, "; ".join(s.reason for s in states if s.status == UPSTREAM),
                                      variant.name))
        else:
            candidates.append(Finding(NOT_APPLICABLE, states[0].reason if states else "nothing to patch",
                                      variant.name))
    if not candidates:
        return Finding(UNSUPPORTED, "no variant recognises this code: " + " | ".join(mismatches))
    # A verified shape beats an untested one; otherwise the first variant that recognises the file.
    candidates.sort(key=lambda f: f.untested)
    return candidates[0]


def rewrite(patch: Patch, pfile: PatchFile, module: cst.Module, finding: Finding) -> cst.Module:
    """Rewrite every pending site; each transformer must match exactly ``site.expect`` times."""
    for site in finding.pending_sites:
        node = h.find_def(module, site.function)
        if node is None:  # pragma: no cover - examine() saw it a moment ago
            raise RewriteError(f"{pfile.path}: {site.function}: function vanished while rewriting")
        transformer = site.rewrite(patch.id)
        try:
            new = node.visit(transformer)
        except RewriteError as exc:  # a transformer refusing the layout it found
            raise RewriteError(f"{pfile.path}: {site.function}: {exc}") from exc
        if transformer.matches != site.expect:
            raise RewriteError(
                f"{pfile.path}: {site.function}: rewrite of anchor {site.anchor} matched "
                f"{transformer.matches} times (expected {site.expect})"
            )
        module = h.replace_def(module, site.function, new)
    return module


class RewriteError(Exception):
    pass


class ReplaceAndMark(CountingTransformer):
    """Replace every node matching ``matcher`` with ``replace(node)`` and put the patch's
    marker comment at the end of each statement line that was changed."""

    def __init__(self, patch_id: str, matcher: m.BaseMatcherNode, replace: Callable[[cst.CSTNode], cst.CSTNode]):
        super().__init__(patch_id)
        self.matcher = matcher
        self.replace = replace
        self._dirty = False

    def on_leave(self, original_node, updated_node):
        if m.matches(original_node, self.matcher):
            self.matches += 1
            self._dirty = True
            updated_node = self.replace(updated_node)
        if self._dirty and isinstance(updated_node, cst.SimpleStatementLine):
            self._dirty = False
            updated_node = mark_line(updated_node, self.patch_id)
        return updated_node


def marked(ws: cst.TrailingWhitespace, patch_id: str) -> cst.TrailingWhitespace:
    """``ws`` (the end of a physical line) with the patch's marker appended to its comment."""
    text = h.marker_text(patch_id) if ws.comment is None else f"{ws.comment.value}  {h.marker_text(patch_id)}"
    return ws.with_changes(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(text))


def mark_line(line: cst.SimpleStatementLine, patch_id: str) -> cst.SimpleStatementLine:
    """Append the patch's marker to a statement line's trailing comment (kept if present)."""
    return line.with_changes(trailing_whitespace=marked(line.trailing_whitespace, patch_id))




def mark_comma(node, patch_id: str):
    """``node`` (a Param, Arg or Element on its own line: ``,`` then a newline) with the patch's
    marker at the end of its line. Not on its own line: returned unchanged (left unmarked)."""
    comma = node.comma
    ws = getattr(comma, "whitespace_after", None)
    if not isinstance(ws, cst.ParenthesizedWhitespace):
        return node
    return node.with_changes(comma=comma.with_changes(whitespace_after=ws.with_changes(
        first_line=marked(ws.first_line, patch_id))))
