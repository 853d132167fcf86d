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
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=SimpleNamespace(non_argmax_invariant=[]),
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

    def __init__(self, req_ids, sm):
        self.input_batch = FakeBatchV1(req_ids, sm)
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
        step = hook.tree_step(runner)
        for rid, par in zip(ids, parents):
            step.attach(rid, par)
        out = v1_patched(runner, logits, md)
        want, acc, rows = ref_greedy(parents, md, logits)
        assert out.sampled_token_ids.dtype == torch.int32
        assert torch.equal(out.sampled_token_ids, want), (seed, out.sampled_token_ids, want)
        assert step.engaged and step.num_reqs == len(sizes)
        assert torch.equal(step.accepted_rows[: len(sizes), : rows.shape[1]], rows)
        assert torch.equal(step.num_accepted[: len(sizes)], acc)
        assert not step._pending  # consumed


@check("v1_tree_sampled_equals_reference")
def _():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch as apply_top_k_top_p

    env(DDTREE_PATCH_ENABLE="1")
    for seed in range(4):
        sizes, parents, drafts, logits = random_batch(100 + seed)
        B = len(sizes)
        md = metadata(drafts)
        temp = torch.tensor([0.0, 0.7, 1.3][:B])  # request 0 greedy, the others sampled
        top_k = torch.tensor([V, 8, V][:B])
        top_p = torch.tensor([1.0, 1.0, 0.9][:B])
        gens = {1: torch.Generator().manual_seed(7)}
        ids = [f"r{i}" for i in range(B)]
        runner = FakeRunnerV1(ids, sampling(B, temperature=temp, top_k=top_k, top_p=top_p, generators=gens))
        step = hook.tree_step(runner)
        for rid, par in zip(ids, parents):
            step.attach(rid, par)
        torch.manual_seed(1000 + seed)
        out = v1_patched(runner, logits, md).sampled_token_ids
        # the same randomness, drawn the same way: global generator, then request 1's generator
        torch.manual_seed(1000 + seed)
        T = logits.shape[0]
        coins = torch.rand(T, dtype=torch.float64)
        q = torch.empty(B, V).exponential_()
        g = torch.Generator().manual_seed(7)
        s = [0] + list(np.cumsum([n + 1 for n in sizes]))
        coins[s[1]:s[2]].uniform_(generator=g)
        q[1].exponential_(generator=g)
        rep = torch.tensor([n + 1 for n in sizes])
        x = logits.float() / torch.where(temp == 0, torch.ones_like(temp), temp).repeat_interleave(rep)[:, None]
        x = apply_top_k_top_p(x, top_k.repeat_interleave(rep), top_p.repeat_interleave(rep))
        par = torch.tensor(sum(parents, []), dtype=torch.int32)
        want, _, _ = tree_verify_ref(md.draft_token_ids, par, md.cu_num_draft_tokens,
                                     target_argmax=logits.argmax(-1), target_probs=torch.softmax(x, -1),
                                     is_greedy=temp == 0, coins=coins, inv_exp_noise=q.reciprocal(),
                                     width=md.max_spec_len + 1)
        assert torch.equal(out, want), (seed, out, want)


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
                assert not hook_obj.engaged and hook_obj.fallbacks == {"no-tree": 1}


@check("v1_unsafe_sampling_falls_back_to_pristine")
def _():
    env(DDTREE_PATCH_CHAIN_AS_TREE="1")
    sizes, parents, drafts, logits = random_batch(300, chain=True)
    B = len(sizes)
    md = metadata(drafts)
    a = FakeRunnerV1([f"r{i}" for i in range(B)], sampling(B, bad_words_token_ids={0: [[5]]}, spec_token_ids=drafts))
    b = FakeRunnerV1([f"r{i}" for i in range(B)], sampling(B, bad_words_token_ids={0: [[5]]}, spec_token_ids=drafts))
    got = v1_patched(a, logits, md).sampled_token_ids
    want = v1_pristine(b, logits, md).sampled_token_ids
    assert torch.equal(got, want)
    assert a.ddtree_hook.fallbacks == {"bad-words": 1}, a.ddtree_hook.fallbacks
    # the other branch-dependent parameters (their chain path needs a GPU: decided, not run)
    rs = a.rejection_sampler
    for kw, reason in (({"no_penalties": False}, "penalties"), ({"max_num_logprobs": 0}, "logprobs"),
                       ({"allowed_token_ids_mask": torch.zeros(B, V, dtype=torch.bool)}, "allowed-token-ids"),
                       ({"logitsprocs": SimpleNamespace(non_argmax_invariant=[SimpleNamespace(min_toks={0: 3})])},
                        "logits-processors")):
        assert hook._v1_unsafe(sampling(B, **kw), rs) == reason, reason
    assert hook._v1_unsafe(sampling(B, temperature=torch.ones(B), top_k=torch.full((B,), 5)), rs) is None


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


# ---- V2 (unit level: the patched V2 module, a fake runner and input batch) ---------------------------
@check("v2_module_imports_patched")
def _():
    import vllm.v1.worker.gpu.model_runner as v2

    assert "# ddtree-patch: tree-walk-hook" in Path(v2.__file__).read_text()
    assert 'bind(self, "V2", hook_abi=2)' in Path(v2.__file__).read_text()


class _Buf:
    def __init__(self, arr):
        self.np = np.asarray(arr)
        self.gpu = torch.from_numpy(self.np.copy())


class FakeV2:
    """What GPUModelRunner.sample (0.24-0.28 shape) and the V2 hook read."""

    def __init__(self, sizes, drafts, logits, temps, prefill_len, seq_lens):
        B = len(sizes)
        self.model = SimpleNamespace(compute_logits=lambda h: h)
        self.structured_outputs_worker = None
        self.speculator = SimpleNamespace(draft_logits=None)
        self.rejection_calls = 0
        self.speculative_config = SimpleNamespace(num_speculative_tokens=K)
        self.max_num_reqs = 8
        self.device = torch.device("cpu")

        def chain(logits, input_batch, draft_logits=None, *a):
            self.rejection_calls += 1
            return SimpleNamespace(num_sampled="chain", num_rejected="chain")

        self.rejection_sampler = SimpleNamespace(__call__=chain, num_speculative_steps=K)
        self.rejection_sampler = chain
        chain.num_speculative_steps = K
        states = SimpleNamespace(
            temperature=_Buf(temps), top_k=_Buf([V] * B), top_p=_Buf([1.0] * B), min_p=_Buf([0.0] * B),
            seeds=_Buf(np.arange(B, dtype=np.int64) + 11), max_num_logprobs=lambda idx: -1)
        self.sampler = SimpleNamespace(sampling_states=states, needs_logits_processing=np.zeros(B, bool),
                                       compute_nans=False)
        self.req_states = SimpleNamespace(prefill_len=_Buf(np.asarray(prefill_len, dtype=np.int32)))
        cu = np.concatenate([[0], np.cumsum([n + 1 for n in sizes])]).astype(np.int32)
        T = int(cu[-1])
        ids = torch.zeros(T, dtype=torch.int64)
        for r, d in enumerate(drafts):
            ids[cu[r] + 1: cu[r] + 1 + len(d)] = torch.tensor(d)
        self.input_batch = SimpleNamespace(
            req_ids=[f"q{i}" for i in range(B)], num_reqs=B, num_draft_tokens=sum(sizes),
            idx_mapping=torch.arange(B, dtype=torch.int32), idx_mapping_np=np.arange(B),
            cu_num_logits=torch.from_numpy(cu), cu_num_logits_np=cu, logits_indices=torch.arange(T),
            input_ids=ids, positions=torch.arange(T) + 100,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
        self.hidden = logits


def v2_sample(fake):
    import vllm.v1.worker.gpu.model_runner as v2

    return v2.GPUModelRunner.sample(fake, fake.hidden, fake.input_batch, None)


@check("v2_tree_greedy_equals_reference_and_prefill_rule")
def _():
    env(DDTREE_PATCH_ENABLE="1")
    for seed in range(4):
        sizes, parents, drafts, logits = random_batch(500 + seed)
        B = len(sizes)
        # request 1 is still in chunked prefill (seq_len < prefill_len): 0 sampled, 0 rejected
        fake = FakeV2(sizes, drafts, logits, [0.0] * B, prefill_len=[5, 50, 5][:B], seq_lens=[10, 20, 10][:B])
        step = hook.tree_step(fake)
        for rid, par in zip(fake.input_batch.req_ids, parents):
            step.attach(rid, par)
        out, num_sampled, num_rejected = v2_sample(fake)
        md = metadata(drafts)
        want, acc, _ = ref_greedy(parents, md, logits)
        assert fake.rejection_calls == 0
        n = acc + 1
        for r in range(B):
            assert torch.equal(out.sampled_token_ids[r, : int(n[r])].to(torch.int32), want[r, : int(n[r])])
        exp_s = torch.where(torch.tensor([10, 20, 10][:B]) < torch.tensor([5, 50, 5][:B]), 0, n)
        exp_r = torch.where(exp_s == 0, 0, torch.tensor(sizes) + 1 - n)
        assert torch.equal(num_sampled.long(), exp_s.long()), (num_sampled, exp_s)
        assert torch.equal(num_rejected.long(), exp_r.long()), (num_rejected, exp_r)


@check("v2_linear_batch_runs_chain_sampler")
def _():
    env(DDTREE_PATCH_ENABLE="1")
    sizes, parents, drafts, logits = random_batch(600, chain=True)
    B = len(sizes)
    fake = FakeV2(sizes, drafts, logits, [0.0] * B, prefill_len=[1] * B, seq_lens=[10] * B)
    out = v2_sample(fake)
    assert fake.rejection_calls == 1 and out[1] == "chain"
    env()
    fake = FakeV2(sizes, drafts, logits, [0.0] * B, prefill_len=[1] * B, seq_lens=[10] * B)
    assert v2_sample(fake)[1] == "chain" and fake.__dict__["ddtree_hook"] is None


@check("v2_chain_as_tree_sampled_runs_kernel")
def _():
    env(DDTREE_PATCH_CHAIN_AS_TREE="1")
    sizes, parents, drafts, logits = random_batch(700, chain=True)
    B = len(sizes)
    fake = FakeV2(sizes, drafts, logits, [0.0, 0.8, 1.0][:B], prefill_len=[1] * B, seq_lens=[10] * B)
    out, ns, nr = v2_sample(fake)
    assert fake.rejection_calls == 0 and fake.ddtree_hook.engaged
    assert torch.equal(ns.long() + nr.long(), torch.tensor(sizes) + 1)
    # request 0 is greedy: exactly the argmax chain
    md = metadata(drafts)
    want, acc, _ = ref_greedy(parents, md, logits)
    assert torch.equal(out.sampled_token_ids[0, : int(acc[0]) + 1].to(torch.int32), want[0, : int(acc[0]) + 1])


print("PROBE-RESULT " + json.dumps(RESULTS), flush=True)
