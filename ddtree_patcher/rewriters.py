"""The libcst transformers a patch's sites rewrite with, and the marker helpers: every line a patch
writes or changes ends with its marker comment (``# ddtree-patch: <id>``). Used by the patch modules
(``patches/*``), by ``patchlib``'s rewrite builders and by ``examine.rewrite``."""

from __future__ import annotations

from typing import Callable

import libcst as cst
import libcst.matchers as m

from ddtree_patcher import cst_helpers as h


class CountingTransformer(cst.CSTTransformer):
    """Base for site transformers: count every rewrite in ``self.matches``."""

    def __init__(self, patch_id: str):
        super().__init__()
        self.patch_id = patch_id
        self.matches = 0


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
