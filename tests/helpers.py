"""Helpers shared by the tests (importable as ``helpers``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def patch_files() -> list[str]:
    """Every file a registered patch reads (its targets and its ``requires``)."""
    from ddtree_patcher.engine import series

    out = set()
    for p in series():
        out.update(p.requires)
        out.update(pf.path for pf in p.files)
        out.update(g for pf in p.files for g in pf.gone_with)
    return sorted(out)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, **popen):
    """Run the installed ``ddtree-patch`` console script; returns (exit code, JSON or None, stderr)."""
    exe = Path(sys.executable).with_name("ddtree-patch")
    base = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # no wrapping unless a test asks
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, env={**base, **(env or {})},
                          timeout=timeout, cwd="/", **popen)
    doc = json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else None
    if "--json" in args and doc is None and proc.returncode in (0, 3, 4, 5, 6):
        raise AssertionError(f"exit {proc.returncode} without JSON on stdout; stderr:\n{proc.stderr}")
    return proc.returncode, doc, proc.stderr


def statuses(doc: dict) -> dict[str, str]:
    return {p["id"]: p["status"] for p in doc["patches"]}


def tree_bytes(site: Path) -> dict[str, bytes]:
    """Every file under site/vllm, for byte-exact comparisons."""
    return {str(p.relative_to(site)): p.read_bytes() for p in sorted((site / "vllm").rglob("*")) if p.is_file()}


def added_lines(before: bytes, after: bytes) -> list[str]:
    """The lines a rewrite added (unified diff of two versions of a file, "+" lines)."""
    import difflib

    return [line[1:] for line in difflib.unified_diff(before.decode().splitlines(), after.decode().splitlines(),
                                                      lineterm="", n=0)
            if line.startswith("+") and not line.startswith("+++")]


ENGINE_TOOLS = REPO / "tests" / "patches" / "engine_tools"


def probe_result(what: str, returncode: int, out: str, err: str, prefix: str = "PROBE-RESULT ") -> dict:
    """The JSON of a probe's last ``prefix`` line; a probe that printed none (an import failure, a
    crash) fails the test with the tails of its output, never skips it."""
    import pytest

    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    if not lines:
        pytest.fail(f"{what} failed (exit {returncode}):\n{out[-3000:]}\n{err[-5000:]}")
    return json.loads(lines[-1][len(prefix):])


def paged_batch(nsched: list[int], ctx: list[int], nb: int, bs: int, g):
    """A paged KV batch for the tree step's FlashAttention tests: request r has ``ctx[r]`` cached
    tokens and ``nsched[r]`` new ones, its blocks drawn from a random permutation of ``nb`` blocks of
    ``bs`` (generator ``g``). Returns ``(seq_lens, block_table, query_start_loc)`` (int32)."""
    import torch

    seq = [c + n for c, n in zip(ctx, nsched)]
    blocks = torch.randperm(nb, generator=g)
    need = [(s + bs - 1) // bs for s in seq]
    bt = torch.zeros(len(nsched), max(need), dtype=torch.int32)
    at = 0
    for r, k in enumerate(need):
        bt[r, :k] = blocks[at:at + k]
        at += k
    qsl = torch.tensor([0] + list(torch.tensor(nsched).cumsum(0)), dtype=torch.int32)
    return torch.tensor(seq, dtype=torch.int32), bt, qsl


def bare_tree_step(**attrs):
    """A ``TargetTreeStep`` on CPU without a runner (``__new__`` + ``_init_state``: no layers bound,
    no graph buffers), ``attrs`` set on it: what the tree step's unit tests drive directly."""
    import torch

    from ddtree_patcher.runtime.tree_step import TargetTreeStep

    st = TargetTreeStep.__new__(TargetTreeStep)
    st._init_state()
    st.device = torch.device("cpu")
    for k, v in attrs.items():
        setattr(st, k, v)
    return st


def set_plan(step, B: int, T: int, num_scheduled_tokens, trees, positions=None) -> None:
    """A tree step's plan from ``trees`` [(batch row, n nodes, local parents [n])] (rows in batch
    order, ``num_scheduled_tokens`` per row), through the runtime's own
    ``TargetTreeStep.set_plan_parents``; ``positions`` (linear) get ``ctx + depth`` at the tree rows,
    in place. Test scaffolding: in vLLM the plan comes from the verify-side channel's attachments."""
    import torch

    nd = [0] * B
    for r, n, _ in trees:
        nd[r] = n
    W = max(nd) + 1
    par = torch.full((B, W), -1, dtype=torch.int64, device=step.device)
    for r, n, p in trees:
        par[r, 1:n + 1] = p[:n].to(torch.int64)
    step.set_plan_parents(B, T, num_scheduled_tokens, nd, par, positions)


def cpu_env(**extra) -> dict:
    """The environment for a subprocess running vLLM on CPU (Triton interpreter), without the
    settings of ours or vLLM's that would change which code runs; ``extra`` on top."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    for k in ("VLLM_TARGET_DEVICE", "DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE", "DDTREE_PATCH_ON_DRIFT",
              "VLLM_USE_V2_MODEL_RUNNER", "PYTHONPATH"):
        env.pop(k, None)
    env.update(extra)
    return env


def engine_run(tag: str, path: str, ckpt: Path, log: Path, spec: bool, **env) -> dict:
    """One ``engine_tools/run_llm_hook.py`` run on CPU with vLLM from ``path`` (PYTHONPATH) and the
    tiny checkpoints at ``ckpt``: its RESULT (``{"ok": False, ...}`` when it printed none), with
    ``log`` (stderr, then stdout) under "log"."""
    e = cpu_env(PYTHONPATH=path, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", CPU="1",
                DTYPE="float32", ROOT=str(ckpt), TAG=tag, SPEC="1" if spec else "0", EAGER="1", **env)
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, str(ENGINE_TOOLS / "run_llm_hook.py")], stdout=subprocess.PIPE,
                              stderr=fh, text=True, timeout=600, env=e, cwd=str(log.parent))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    res = json.loads(lines[-1][len("RESULT "):]) if lines else {"ok": False, "error": f"no RESULT line (exit {proc.returncode})"}
    res["log"] = log.read_text() + proc.stdout
    return res


def assert_shapes_are_those_of_the_wheels(patch, claimed=lambda version, path, variant: True) -> None:
    """Every shape hash a variant lists is the pristine ``cst`` hash of its function in a release
    the variant was verified on (``claimed(version, path, variant name)`` narrows which releases
    count, e.g. only those where the variant is the one expected to be pending). Each release's
    file is parsed once for all the variants and functions that claim it."""
    import libcst as cst

    import vllm_wheels
    from ddtree_patcher import cst_helpers as h

    for pf in patch.files:
        need: dict = {}  # version -> [(variant name, function)]
        for variant in pf.variants:
            for fn in variant.shapes:
                for version in variant.verified_on:
                    if claimed(version, pf.path, variant.name):
                        need.setdefault(version, []).append((variant.name, fn))
        seen: dict = {}
        for version, items in need.items():
            module = cst.parse_module((vllm_wheels.extracted(version) / pf.path).read_bytes())
            for name, fn in items:
                seen.setdefault((name, fn), set()).add(h.shape_hash(module, h.find_def(module, fn)))
        for variant in pf.variants:
            for fn, hashes in variant.shapes.items():
                got = seen.get((variant.name, fn), set())
                assert got == set(hashes), (pf.path, variant.name, fn, got)
