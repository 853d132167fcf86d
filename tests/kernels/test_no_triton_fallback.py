"""Without Triton, ``ddtree_patcher.kernels`` still imports and falls back to the reference."""

import os
import pathlib
import subprocess
import sys

SCRIPT = r"""
import sys, warnings
sys.modules["triton"] = None            # make `import triton` fail
sys.modules["triton.language"] = None
sys.path.insert(0, sys.argv[1])
from _shim import ensure_kernels_importable
k = ensure_kernels_importable()
import torch
assert k.TRITON_AVAILABLE is False
tok = torch.tensor([11, 12, 13, 12], dtype=torch.int32)
par = torch.tensor([0, 1, 0, 3], dtype=torch.int32)
cu = torch.tensor([4], dtype=torch.int32)
am = torch.tensor([13, 5, 5, 12, 7], dtype=torch.int32)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out, acc, rows = k.tree_verify(tok, par, cu, target_argmax=am, width=5)
assert any("PyTorch reference" in str(x.message) for x in w), [str(x.message) for x in w]
assert out.tolist() == [[13, 12, 7, -1, -1]], out
print("FALLBACK OK")
"""


def test_import_without_triton_falls_back_to_reference():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(pathlib.Path(__file__).parent)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "FALLBACK OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
