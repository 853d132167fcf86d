"""Small libcst helpers shared by the patch modules (never patch-specific)."""

from __future__ import annotations

import hashlib
from typing import Iterator

import libcst as cst
import libcst.matchers as m


def iter_defs(body) -> Iterator[cst.CSTNode]:
    for node in body:
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            yield node


def find_def(module: cst.Module, qualname: str) -> cst.FunctionDef | cst.ClassDef | None:
    """The function or class at ``qualname`` ("Class.method", "function"), or None.

    Only direct definitions are followed (no definitions inside ``if`` blocks); two
    definitions of one name is ambiguous and returns None too.
    """
    body = module.body
    node = None
    for part in qualname.split("."):
        found = [n for n in iter_defs(body) if n.name.value == part]
        if len(found) != 1:
            return None
        node = found[0]
        body = node.body.body if isinstance(node.body, cst.IndentedBlock) else ()
    return node


def shape_hash(module: cst.Module, node: cst.CSTNode) -> str:
    """sha256 (12 hex digits) of the node's code, decorators included, leading lines dropped.

    This is the ``cst`` shape hash of docs/design.md ("Selection by shape"): it changes on any
    edit, comments and docstrings included, so it only tells known shapes from new ones.
    """
    if hasattr(node, "leading_lines"):
        node = node.with_changes(leading_lines=())
    return hashlib.sha256(module.code_for_node(node).encode()).hexdigest()[:12]


def count(node: cst.CSTNode, matcher) -> int:
    return len(m.findall(node, matcher))


def contains_text(module: cst.Module, node: cst.CSTNode, text: str) -> bool:
    return text in module.code_for_node(node)


def marker_text(patch_id: str) -> str:
    return f"# ddtree-patch: {patch_id}"


def replace_def(module: cst.Module, qualname: str, new: cst.CSTNode) -> cst.Module:
    """``module`` with the definition at ``qualname`` replaced by ``new``.

    Rebuilds only the nodes on the path to the definition (``Module.deep_replace`` walks and
    rebuilds the whole tree, seconds on a 7,000-line runner)."""

    def rebuild(container, parts: list[str]):
        body = container.body if isinstance(container, cst.Module) else container.body.body
        idx = next(i for i, n in enumerate(body)
                   if isinstance(n, (cst.FunctionDef, cst.ClassDef)) and n.name.value == parts[0])
        child = new if len(parts) == 1 else rebuild(body[idx], parts[1:])
        body = (*body[:idx], child, *body[idx + 1:])
        if isinstance(container, cst.Module):
            return container.with_changes(body=body)
        return container.with_changes(body=container.body.with_changes(body=body))

    return rebuild(module, qualname.split("."))
