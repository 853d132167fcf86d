"""The runtime: what a *patched* vLLM process imports (never the offline engine).

* ``hook``  tree-walk-hook: the per-runner ``VerifyStep`` the sampling call sites call;
* ``swa``   dflash-sliding-window: what the rewritten drafter layers call while being built;
* ``guard`` the boot guard (``vllm.general_plugins`` entry point).

Nothing here imports torch or vLLM at import time; the offline engine (resolve, scan, plan,
transaction, CLI) never imports this package except to read an ABI number.
"""
