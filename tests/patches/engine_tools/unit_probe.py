"""Unit probe for the tree-walk-hook (run in a subprocess by tests/patches/test_tree_walk_hook.py).

argv: SITE (a site folder whose vllm/ carries the patched runner files), PRISTINE (the
unpatched wheel's site folder). Prints ``PROBE <name> ok|FAIL <detail>`` lines and a final
``PROBE-RESULT {json}``. Needs CUDA_VISIBLE_DEVICES="" and TRITON_INTERPRET=1 (set below,
before torch/triton/vllm are imported).
"""
from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
os.environ.pop("DDTREE_PATCH_ENABLE", None)
os.environ.pop("DDTREE_PATCH_CHAIN_AS_TREE", None)

import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

SITE, PRISTINE = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(SITE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.rejection_sampler import RejectionSampler  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402
import vllm.v1.worker.gpu_model_runner as patched_v1  # noqa: E402

from ddtree_patcher.runtime import hook  # noqa: E402
from ddtree_patcher.kernels import tree_verify_ref  # noqa: E402

assert Path(vllm.__file__).parent == SITE / "vllm", vllm.__file__
assert "# ddtree-patch: tree-walk-hook" in Path(patched_v1.__file__).read_text()


def _load_pristine(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, PRISTINE / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pristine_v1 = _load_pristine("vllm/v1/worker/gpu_model_runner.py", "vllm.v1.worker._ddtree_pristine_gpu_model_runner")
assert "ddtree-patch" not in Path(pristine_v1.__file__).read_text()

RESULTS: dict[str, str] = {}


def check(name):
    def deco(fn):
        try:
            fn()
            RESULTS[name] = "ok"
        except Exception:
            RESULTS[name] = "FAIL " + traceback.format_exc()[-3000:]
        print("PROBE", name, RESULTS[name], flush=True)
        return fn
    return deco


# ---- V1 ---------------------------------------------------------------------------------------
V, K = 64, 4


def metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    num = [len(d) for d in drafts]
    tgt, bonus, start = [], [], 0
    for r, n in enumerate(num):
        row0 = start + r
        tgt += [row0 + j for j in range(n)]
        bonus.append(row0 + n)
        start += n
    T = sum(num) + len(num)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32),
        num_draft_tokens=num,
        cu_num_draft_tokens=torch.tensor(np.cumsum(num), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(np.cumsum([n + 1 for n in num]), dtype=torch.int32),
        target_logits_indices=torch.tensor(tgt, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(T, dtype=torch.int32),
    )


def sampling(B, temperature=None, top_k=None, top_p=None, generators=None, **kw):
    greedy = temperature is None
    args = dict(
        temperature=temperature, all_greedy=greedy, all_random=not greedy and bool((temperature > 0).all()),
        top_p=top_p, top_k=top_k, generators=generators or {}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(B), presence_penalties=torch.zeros(B),
        repetition_penalties=torch.ones(B), output_token_ids=[[] for _ in range(B)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )
    args.update(kw)
    return SamplingMetadata(**args)


class FakeBatchV1:
    def __init__(self, req_ids, sm):
        self.req_ids = req_ids
        self.sampling_metadata = sm

    def update_async_output_token_ids(self):
        pass


class FakeRunnerV1:
    """The attributes GPUModelRunner._sample reads, with vLLM's real samplers."""

    def __init__(self, req_ids, sm, params=None):
        from vllm.sampling_params import SamplingParams

        self.input_batch = FakeBatchV1(req_ids, sm)
        self.requests = {r: SimpleNamespace(sampling_params=(params or {}).get(r, SamplingParams(temperature=0.0)))
                         for r in req_ids}
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.use_async_scheduling = False
        self._draft_token_req_ids = None
        self.speculative_config = SimpleNamespace(num_speculative_tokens=K)
        self.max_num_reqs = 8
        self.device = torch.device("cpu")

    def _get_spec_decode_draft_probs(self, m):
        return None


def random_batch(seed, B=3, chain=False):
    """Trees with random parents, drafts partly matching the target argmax."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(1, K + 1, (B,), generator=g)]
    sizes[0] = K
    parents = [[0 if chain is False and j == 0 else (j if chain else int(torch.randint(0, j + 1, (1,), generator=g)))
                for j in range(n)] for n in sizes]
    if chain:
        parents = [list(range(n)) for n in sizes]
    T = sum(sizes) + B
    logits = torch.randn(T, V, generator=g)
    drafts, start = [], 0
    for r, (n, par) in enumerate(zip(sizes, parents)):
        row0 = start + r
        toks = []
        for j in range(1, n + 1):
            p = par[j - 1]
            am = int(logits[row0 + p].argmax())
            toks.append(am if torch.rand(1, generator=g).item() < 0.7 else (am + 1 + j) % V)
        drafts.append(toks)
        start += n
    return sizes, parents, drafts, logits


def env(**kv):
    for k in ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE"):
        os.environ.pop(k, None)
    os.environ.update({k: v for k, v in kv.items()})


def v1_patched(runner, logits, md):
    return patched_v1.GPUModelRunner._sample(runner, logits.clone(), md)


def v1_pristine(runner, logits, md):
    return pristine_v1.GPUModelRunner._sample(runner, logits.clone(), md)


def ref_greedy(parents, md, logits):
    par = torch.tensor(sum(parents, []), dtype=torch.int32)
    return tree_verify_ref(md.draft_token_ids, par, md.cu_num_draft_tokens, target_argmax=logits.argmax(-1),
                           width=md.max_spec_len + 1)


@check("v1_tree_greedy_equals_reference")
def _():
    env(DDTREE_PATCH_ENABLE="1")
    for seed in range(6):
        sizes, parents, drafts, logits = random_batch(seed)
        md = metadata(drafts)
        ids = [f"r{i}" for i in range(len(sizes))]
        runner = FakeRunnerV1(ids, sampling(len(sizes)))
        step = hook.verify_step(runner)
        for rid, par in zip(ids, parents):
            step.attach(rid, par)
        out = v1_patched(runner, logits, md)
        want, acc, rows = ref_greedy(parents, md, logits)
        assert out.sampled_token_ids.dtype == torch.int32
        assert torch.equal(out.sampled_token_ids, want), (seed, out.sampled_token_ids, want)
        assert step.engaged and step.num_reqs == len(sizes)
        assert torch.equal(step.accepted_rows[: len(sizes), : rows.shape[1]], rows)
        assert torch.equal(step.num_accepted[: len(sizes)], acc)
        assert not step._where  # consumed


@check("v1_linear_batch_equals_pristine")
def _():
    for mode in ({}, {"DDTREE_PATCH_ENABLE": "1"}, {"DDTREE_PATCH_CHAIN_AS_TREE": "1"}):
        env(**mode)
        for seed in range(4):
            sizes, parents, drafts, logits = random_batch(200 + seed, chain=True)
            md = metadata(drafts)
            ids = [f"r{i}" for i in range(len(sizes))]
            a = FakeRunnerV1(ids, sampling(len(sizes)))
            b = FakeRunnerV1(ids, sampling(len(sizes)))
            got = v1_patched(a, logits, md).sampled_token_ids
            want = v1_pristine(b, logits, md).sampled_token_ids
            assert torch.equal(got, want), (mode, seed, got, want)
            hook_obj = a.__dict__.get("ddtree_hook")
            if not mode:
                assert hook_obj is None  # not requested: vLLM's chain sampler, nothing bound
            elif "DDTREE_PATCH_CHAIN_AS_TREE" in mode:
                assert hook_obj.engaged and hook_obj.engaged_steps == 1  # went through the kernel
            else:
                assert not hook_obj.engaged and set(hook_obj.fallbacks) == {"no-tree"}


@check("v1_unsafe_sampling_falls_back_to_pristine")
def _():
    from vllm.sampling_params import SamplingParams

    env(DDTREE_PATCH_CHAIN_AS_TREE="1")
    sizes, parents, drafts, logits = random_batch(300, chain=True)
    B = len(sizes)
    md = metadata(drafts)
    ids = [f"r{i}" for i in range(B)]
    bad = SamplingParams(temperature=0.0)
    bad._bad_words_token_ids = [[5]]
    a = FakeRunnerV1(ids, sampling(B, bad_words_token_ids={0: [[5]]}, spec_token_ids=drafts), {"r0": bad})
    b = FakeRunnerV1(ids, sampling(B, bad_words_token_ids={0: [[5]]}, spec_token_ids=drafts), {"r0": bad})
    got = v1_patched(a, logits, md).sampled_token_ids
    want = v1_pristine(b, logits, md).sampled_token_ids
    assert torch.equal(got, want)
    # request r0 alone took vLLM's chain sampler; the others went through the walk
    assert a.ddtree_hook.fallbacks == {"bad-words": 1}, a.ddtree_hook.fallbacks
    assert a.ddtree_hook.engaged and a.ddtree_hook.tree_requests == B - 1
    from ddtree_patcher.runtime import parity_v1

    for kw, reason in (({"presence_penalty": 0.5}, "penalties"), ({"logprobs": 1}, "logprobs"),
                       ({"min_tokens": 3}, "min-tokens"), ({"repetition_penalty": 1.2}, "penalties")):
        assert parity_v1.params_reason(SamplingParams(**kw)) == reason, reason
    for kw in ({"temperature": 0.7, "top_k": 5}, {"logit_bias": {3: 2.0}}, {"min_p": 0.1},
               {"allowed_token_ids": [1, 2]}, {"seed": 3, "temperature": 1.0}):
        assert parity_v1.params_reason(SamplingParams(**kw)) is None, kw


@check("v1_missing_runtime_is_a_clear_error")
def _():
    env(DDTREE_PATCH_ENABLE="1")
    sizes, parents, drafts, logits = random_batch(400, chain=True)
    md = metadata(drafts)
    runner = FakeRunnerV1([f"r{i}" for i in range(len(sizes))], sampling(len(sizes)))
    saved = sys.modules.get("ddtree_patcher.runtime.hook")
    sys.modules["ddtree_patcher.runtime.hook"] = None  # what a missing module looks like to `import`
    try:
        v1_patched(runner, logits, md)
    except RuntimeError as e:
        assert "ddtree_patcher.runtime.hook (hook ABI 2) cannot be imported" in str(e), e
        assert "ddtree-patch revert" in str(e)
    else:
        raise AssertionError("no error")
    finally:
        sys.modules["ddtree_patcher.runtime.hook"] = saved
    try:
        hook.bind(runner, "V1", hook_abi=hook.HOOK_ABI + 1)
    except hook.HookABIError as e:
        assert f"hook ABI {hook.HOOK_ABI + 1}" in str(e) and "ddtree-patch apply" in str(e)
    else:
        raise AssertionError("no ABI error")


# ---- V2 ------------------------------------------------------------------------------------------
# The V2 hook is tested against the release's real Sampler/RejectionSampler in
# tests/patches/hook_parity (parity_probe.py); here only that the patched module imports.
@check("v2_module_imports_patched")
def _():
    import vllm.v1.worker.gpu.model_runner as v2

    assert "# ddtree-patch: tree-walk-hook" in Path(v2.__file__).read_text()
    assert 'bind(self, "V2", hook_abi=2)' in Path(v2.__file__).read_text()


print("PROBE-RESULT " + json.dumps(RESULTS), flush=True)
