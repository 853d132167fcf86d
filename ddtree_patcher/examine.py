"""Classify and rewrite parsed files for a patch (the libcst half of the patch model)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddtree_patcher import cst_helpers as h
from ddtree_patcher.rewriters import RewriteError
from ddtree_patcher.patchlib import (
    APPLIED, DRIFTED, NOT_APPLICABLE, PENDING, UNSUPPORTED, UPSTREAM, Finding, Patch, PatchFile, Site,
)


@dataclass(frozen=True)
class _SiteState:
    status: str  # applied | upstream | not-applicable | pending | mismatch
    reason: str
    node: cst.CSTNode | None = None


def site_state(patch: Patch, path: str, module: cst.Module, site: Site, marked: bool) -> _SiteState:
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
        states = [site_state(patch, pfile.path, module, s, marked) for s in variant.sites]
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
