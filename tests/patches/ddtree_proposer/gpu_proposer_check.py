"""H200 check of the ddtree-proposer's device path (torch + Triton, no vLLM needed).

Run from the repository root on a CUDA machine:

    python tests/patches/ddtree_proposer/gpu_proposer_check.py

For B in {1, 8, 64} (L = 16, N = 64, V = 151,936, bf16 logits): captures the V2 draft step
(``DDTreeDrafter.draft_v2``: logits -> build_tree -> node tokens, parents, chains into fixed
buffers) in a CUDA graph, replays it on fresh logits and checks tokens/parents against
``build_tree_ref``; runs the eager per-request selection (``select`` + ``upload``) under
``torch.cuda.set_sync_debug_mode("error")``; prints one line per B:
``B=8 graph_ok=True nosync_ok=True replay_median_us=...`` and finally ``GPU-PROPOSER-CHECK ok``.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

try:
    import ddtree_patcher.kernels  # noqa: F401  (installed)
except ImportError:  # a source checkout: kernels/ is installed as ddtree_patcher.kernels
    import kernels

    sys.modules["ddtree_patcher.kernels"] = kernels
from ddtree_patcher.kernels import build_tree_ref  # noqa: E402
from ddtree_patcher.runtime.ddtree import DDTreeDrafter  # noqa: E402

L, N, V, R = 16, 64, 151_936, 64
dev = torch.device("cuda")


def main() -> int:
    ok_all = True
    for B in (1, 8, 64):
        dd = DDTreeDrafter("V2", N, L, dev, R)
        dd.alloc_v2()
        logits = torch.empty(R * L, V, dtype=torch.bfloat16, device=dev)
        spec = SimpleNamespace(draft_tokens=torch.zeros(R, N, dtype=torch.int64, device=dev),
                               model=SimpleNamespace(compute_logits=lambda h: logits[: h.shape[0]]))
        hidden = torch.zeros(B * L, 1, device=dev)
        logits.normal_()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up (Triton compilation) outside the capture
                dd.draft_v2(spec, hidden, B)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dd.draft_v2(spec, hidden, B)
        logits.normal_()
        g.replay()
        torch.cuda.synchronize()
        ref = build_tree_ref(logits[: B * L].view(B, L, V), N, ancestor_mask=False, spine_first=True)
        graph_ok = (torch.equal(spec.draft_tokens[:B].cpu(), ref.tokens.to(torch.int64).clamp_min(0).cpu())
                    and torch.equal(dd.parents_v2[:B].cpu(), ref.parents.cpu()))
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0)
        flags = [i % 2 == 0 for i in range(B)]
        nosync_ok = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens, parents = dd.select(dd.upload(flags), spec.draft_tokens[:B], dd.parents_v2[:B], dd.chain_v2[:B])
        except RuntimeError as e:
            nosync_ok = False
            print("sync in select/upload:", e)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        print(f"B={B} graph_ok={graph_ok} nosync_ok={nosync_ok} replay_median_us={statistics.median(times):.1f}",
              flush=True)
        ok_all &= graph_ok and nosync_ok
    print("GPU-PROPOSER-CHECK", "ok" if ok_all else "FAIL")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
