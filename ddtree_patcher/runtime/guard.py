"""Boot guard: a ``vllm.general_plugins`` entry point (``ddtree_patcher.runtime.guard:register``).

vLLM calls ``register()`` in every process it starts (front end, engine core, workers). It
checks, by sha256 only (milliseconds, no libcst, no second import of vLLM), that the files the
tree-walk-hook rewrote are exactly what ``ddtree-patch apply`` recorded in
``<site>/.ddtree-patch/state.json`` and that their call sites speak this runtime's hook ABI,
then logs one line:

* ``ddtree-patch: hook active, runner=V2, vLLM 0.26.0, mode=ddtree budget=63`` (DDTree requested,
  hook intact; the mode is ``ddtree budget=N`` or ``chain-as-tree``);
* ``ddtree-patch: hook installed, inactive (DDTree not requested ...), runner=..., vLLM ...``;
* ``ddtree-patch: hook NOT active: <why>, runner=..., vLLM ...``.

With ``DDTREE_PATCH_ENABLE=1`` it also checks the ddtree-proposer patch (the DFlash drafter's
tree call sites) the same way and validates ``DDTREE_PATCH_BUDGET`` (a bad value, or both
switches at once, raises ``DDTreeConfigError`` whatever ``DDTREE_PATCH_ON_DRIFT`` says), and,
where ddtree-tree-step is applied, its files (runner, attention backends): a drifted tree step
raises whatever ``DDTREE_PATCH_ON_DRIFT`` says (trees scored by a chain-shaped target pass would
change the output; a tree step that is not applied at all is refused by name when the
speculative config is built).

When DDTree is requested (``DDTREE_PATCH_ENABLE`` / ``DDTREE_PATCH_CHAIN_AS_TREE``) and the hook
is not intact it raises (vLLM's loader swallows exceptions raised while *importing* a plugin,
not those of the registered function); ``DDTREE_PATCH_ON_DRIFT=warn`` downgrades that to a
warning. ``runner=`` is read from the ``VllmConfig`` of the calling frame (engine core, worker)
or ``VLLM_USE_V2_MODEL_RUNNER``; where neither says (the front end, before the config exists)
it is ``auto`` and the runner's own ``hook active`` line names it at its first speculative step.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

from ddtree_patcher.runtime.switches import ENV_ON_DRIFT, DDTreeConfigError, check_all, on_drift

PATCH_ID = "tree-walk-hook"
PROPOSER_ID = "ddtree-proposer"
TREE_STEP_ID = "ddtree-tree-step"
_ABI_RE = re.compile(rb'bind\(self, "V[12]", hook_abi=(\d+)\)')
_DDTREE_ABI_RE = re.compile(rb'ddtree_abi=(\d+)\)')
_TREE_STEP_ABI_RE = re.compile(rb'tree_step_abi=(\d+)\)')

logger = logging.getLogger("vllm.ddtree_patch")  # under vLLM's own handler


class HookNotIntact(RuntimeError):
    pass


def _site() -> Path | None:
    mod = sys.modules.get("vllm")
    spec = getattr(mod, "__spec__", None) or importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    return Path(os.path.abspath(spec.origin)).parent.parent  # not resolved: the site may hold links


def _version(site: Path) -> str:
    ver = getattr(sys.modules.get("vllm"), "__version__", None)
    if ver:
        return str(ver)
    try:
        text = (site / "vllm" / "_version.py").read_text()
        found = re.search(r"""(?:__version__|version)\s*(?::\s*str)?\s*=\s*['"]([^'"]+)['"]""", text)
        return found.group(1) if found else "?"
    except OSError:
        return "?"


def _runner() -> str:
    """V1 | V2 | auto, from the caller's VllmConfig (engine core, worker) or the environment."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        for name in ("vllm_config", "self"):
            obj = frame.f_locals.get(name)
            cfg = obj if name == "vllm_config" else getattr(obj, "vllm_config", None)
            if cfg is not None and hasattr(type(cfg), "use_v2_model_runner"):
                try:
                    return "V2" if cfg.use_v2_model_runner else "V1"
                except Exception:  # pragma: no cover - a config that cannot decide yet
                    break
        frame = frame.f_back
    env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if env is not None and env.strip():
        return "V2" if env.strip().lower() in ("1", "true") else "V1"
    return "auto"


def _runtime_abi(patch_id: str) -> tuple[int, "re.Pattern[bytes]"]:
    if patch_id == PROPOSER_ID:
        from ddtree_patcher.runtime.ddtree import DDTREE_ABI

        return DDTREE_ABI, _DDTREE_ABI_RE
    if patch_id == TREE_STEP_ID:
        from ddtree_patcher.runtime.tree_step import TREE_STEP_ABI

        return TREE_STEP_ABI, _TREE_STEP_ABI_RE
    from ddtree_patcher.runtime.hook import HOOK_ABI

    return HOOK_ABI, _ABI_RE


def check(site: Path | None = None, patch_id: str = PATCH_ID) -> tuple[bool, str]:
    """(intact, reason): the patch's files are as recorded and speak this runtime's ABI."""
    abi, abi_re = _runtime_abi(patch_id)
    site = site or _site()
    if site is None:
        return False, "vllm is not importable"
    try:
        from ddtree_patcher.patches import SERIES
        from ddtree_patcher.state import load_state

        state = load_state(site, {p.id for p in SERIES})
    except Exception as exc:  # Refused / EnvironmentProblem: unreadable or tampered state
        return False, f"state unreadable ({exc})"
    if patch_id not in state.patches:
        return False, f"{patch_id} is not applied to {site / 'vllm'} (run `ddtree-patch apply`)"
    files = {rel: rec for rel, rec in state.files.items() if patch_id in rec.patches}
    if not files:
        return False, f"{patch_id} is recorded but no file carries it"
    for rel, rec in sorted(files.items()):
        try:
            data = (site / rel).read_bytes()
        except OSError as exc:
            return False, f"{rel}: {exc.strerror or exc}"
        digest = hashlib.sha256(data).hexdigest()
        if digest != rec.patched:
            what = "back to the pristine bytes (vLLM reinstalled?)" if digest == rec.pristine else \
                "changed since apply"
            return False, f"{rel} is {what}: run `ddtree-patch verify`, then `ddtree-patch apply`"
        abis = {int(a) for a in abi_re.findall(data)}
        if (abis or patch_id == PATCH_ID) and abis != {abi}:  # every hook file carries its ABI
            return False, (f"{rel}: call site {'hook' if patch_id == PATCH_ID else patch_id} ABI "
                           f"{sorted(abis)} != runtime ABI {abi}: "
                           "`ddtree-patch revert && ddtree-patch apply` with the installed tool")
    return True, "intact"


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    from ddtree_patcher.runtime import ddtree
    from ddtree_patcher.runtime.hook import requested

    site = _site()
    intact, reason = check(site)
    ver = _version(site) if site else "?"
    runner = _runner()
    try:
        check_all()  # every DDTREE_PATCH_* value, whatever DDTREE_PATCH_ON_DRIFT says
        want = requested()
        mode = ddtree.mode_line()
    except DDTreeConfigError as exc:
        logger.error("ddtree-patch: DDTree NOT active: %s, runner=%s, vLLM %s", exc, runner, ver)
        raise
    if intact and want:
        line = f"ddtree-patch: hook active, runner={runner}, vLLM {ver}, {mode}"
    elif intact:
        line = (f"ddtree-patch: hook installed, inactive (DDTree not requested: set DDTREE_PATCH_ENABLE=1), "
                f"runner={runner}, vLLM {ver}")
    else:
        line = f"ddtree-patch: hook NOT active: {reason}, runner={runner}, vLLM {ver}"
    if want and not intact:
        if on_drift() == "warn":
            logger.warning("%s (%s=warn: continuing with vLLM's chain sampler)", line, ENV_ON_DRIFT)
            return
        logger.error(line)
        raise HookNotIntact(line + f" (DDTree is requested; set {ENV_ON_DRIFT}=warn to continue without it)")
    logger.info(line)
    if ddtree.enabled():  # DDTree trees need the drafter's call sites too
        ok, why = check(site, PROPOSER_ID)
        if not ok:
            line = f"ddtree-patch: DDTree drafting NOT active: {why}, runner={runner}, vLLM {ver}"
            if on_drift() == "warn":
                logger.warning("%s (%s=warn: continuing; DFlash drafts chains)", line, ENV_ON_DRIFT)
                return
            logger.error(line)
            raise HookNotIntact(line + f" (DDTree is requested; set {ENV_ON_DRIFT}=warn to continue without it)")
        # the tree-shaped target step: where it is applied its files must be intact (where it is not,
        # DDTree refuses to start by name when the speculative config is built)
        ok, why = check(site, TREE_STEP_ID)
        if not ok and "is not applied" not in why:
            line = f"ddtree-patch: DDTree tree step NOT intact: {why}, runner={runner}, vLLM {ver}"
            logger.error(line)  # never downgraded: trees scored as chains would change the output
            raise HookNotIntact(line)
