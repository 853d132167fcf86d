"""Real vLLM objects for the hook probes (imported by parity_probe.py, defects.py, dist.py).

Import after ``sys.path`` holds the release's site folder (the probe does it). Nothing here
replaces vLLM code: a "runner" is a namespace holding the release's own objects (the attributes
the hook reads), built the way the release's model runner builds them:

* V1: ``VllmConfig`` (a real ``SpeculativeConfig`` when ``spec=True``, as with a drafter), the
  logits processors from the release's ``build_logitsprocs`` (with speculative decoding: only
  ``MinTokensLogitsProcessor``; without: every built-in, ``LogitBiasLogitsProcessor`` and
  ``MinPLogitsProcessor`` included), the release's ``InputBatch`` and ``CachedRequestState``
  (``SamplingMetadata`` from ``InputBatch.refresh_metadata``), ``Sampler``, ``RejectionSampler``;
* V2: ``RequestState``, ``Sampler`` (its per-request states), ``RejectionSampler``.

cpu_shim.install() stands in for pinned memory / UVA views only (see there).
"""
from __future__ import annotations

import inspect
import math
import os
import sys
import time
import traceback
from types import SimpleNamespace

import numpy as np
import torch

DEV = torch.device("cpu")
MAXLEN = 256
RESULTS: dict[str, str] = {}


def check(name):
    """Run fn now; record ``ok`` or ``FAIL <traceback>`` under name (one PROBE line)."""
    def deco(fn):
        t = time.perf_counter()
        try:
            fn()
            RESULTS[name] = "ok"
        except Exception:
            RESULTS[name] = "FAIL " + traceback.format_exc()[-4000:]
        print("PROBE", name, RESULTS[name], f"({time.perf_counter() - t:.1f}s)", flush=True)
        return fn
    return deco


def env(**kv):
    for k in ("DDTREE_PATCH_ENABLE", "DDTREE_PATCH_CHAIN_AS_TREE"):
        os.environ.pop(k, None)
    os.environ.update(kv)


def _kw(fn, **available):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in available.items() if k in params}


def install_shim():
    import cpu_shim

    cpu_shim.install()


# ==== V1 ========================================================================================
_CONFIGS: dict = {}


def v1_config(spec: bool, k: int, maxr: int):
    key = (spec, k, maxr)
    if key not in _CONFIGS:
        from vllm.config import DeviceConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

        sched = SchedulerConfig(**_kw(SchedulerConfig, max_num_seqs=maxr, max_model_len=MAXLEN,
                                      max_num_batched_tokens=max(4096, maxr * (k + 1)),
                                      is_encoder_decoder=False))
        sc = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3,
                               prompt_lookup_min=1) if spec else None
        _CONFIGS[key] = VllmConfig(device_config=DeviceConfig(device="cpu"), scheduler_config=sched,
                                   speculative_config=sc)
    return _CONFIGS[key]


class V1World:
    """A V1 batch as the release's GPUModelRunner holds it: InputBatch, requests, samplers."""

    def __init__(self, sps, *, vocab: int, k: int, spec: bool = True, maxr: int | None = None,
                 prompts=None, outputs=None, ids=None):
        install_shim()
        from vllm.sampling_params import SamplingType
        from vllm.v1.sample.logits_processor import build_logitsprocs
        from vllm.v1.sample.rejection_sampler import RejectionSampler
        from vllm.v1.sample.sampler import Sampler
        from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

        B = len(sps)
        maxr = maxr or max(8, B)
        cfg = v1_config(spec, k, maxr)
        procs = build_logitsprocs(cfg, DEV, False, False)
        self.procs = [type(p).__name__ for p in procs.all]
        self.ib = InputBatch(**_kw(
            InputBatch, max_num_reqs=maxr, max_model_len=MAXLEN, max_num_batched_tokens=maxr * (k + 1),
            device=DEV, pin_memory=False, vocab_size=vocab, block_sizes=[16], kernel_block_sizes=[16],
            max_num_blocks_per_req=[MAXLEN // 16], logitsprocs=procs, is_spec_decode=spec,
            num_spec_tokens=k if spec else 0))
        self.ids = ids or [f"req{i}" for i in range(B)]
        self.requests = {}
        fields = set(inspect.signature(CachedRequestState).parameters)
        for i, (rid, sp) in enumerate(zip(self.ids, sps)):
            prompt = list(prompts[i]) if prompts else [1 + (7 * i + j) % (vocab - 1) for j in range(6)]
            out = list(outputs[i]) if outputs else []
            gen = None
            if sp.sampling_type == SamplingType.RANDOM_SEED:  # as GPUModelRunner._update_states
                gen = torch.Generator(device=DEV)
                gen.manual_seed(sp.seed)
            kw = dict(req_id=rid, prompt_token_ids=prompt, mm_features=[], sampling_params=sp,
                      generator=gen, block_ids=([],), num_computed_tokens=len(prompt) + len(out),
                      output_token_ids=out)
            state = CachedRequestState(**{k2: v for k2, v in kw.items() if k2 in fields})
            self.requests[rid] = state
            self.ib.add_request(state)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.runner = SimpleNamespace(input_batch=self.ib, requests=self.requests, sampler=self.sampler,
                                      rejection_sampler=self.rejection_sampler, device=DEV,
                                      max_num_reqs=maxr,
                                      speculative_config=SimpleNamespace(num_speculative_tokens=k))

    def set_drafts(self, drafts):
        """The step's draft tokens (what the runner writes before sampling), then the metadata."""
        for rid, d in zip(self.ids, drafts):
            if hasattr(self.ib, "update_req_spec_token_ids"):
                self.ib.update_req_spec_token_ids(self.requests[rid], {rid: list(d)} if d else {})
            else:
                self.ib.spec_token_ids[self.ib.req_id_to_index[rid]][:] = list(d)
        self.ib.refresh_metadata()
        return self.ib.sampling_metadata

    def gen_states(self):
        return {i: g.get_state() for i, g in self.ib.sampling_metadata.generators.items()}

    def restore(self, states):
        for i, s in states.items():
            self.ib.sampling_metadata.generators[i].set_state(s)


def v1_spec_metadata(drafts):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    num = [len(d) for d in drafts]
    tgt, bonus, start = [], [], 0
    for r, n in enumerate(num):
        tgt += [start + r + j for j in range(n)]
        bonus.append(start + r + n)
        start += n
    T = sum(num) + len(num)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum((list(d) for d in drafts), []), dtype=torch.int32),
        num_draft_tokens=num,
        cu_num_draft_tokens=torch.tensor(np.cumsum(num), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(np.cumsum([n + 1 for n in num]), dtype=torch.int32),
        target_logits_indices=torch.tensor(tgt, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(T, dtype=torch.int32))


# ==== V2 ========================================================================================
class V2World:
    """The V2 runner's RequestState, Sampler (with its per-request states), RejectionSampler."""

    def __init__(self, sps, *, vocab: int, k: int, maxr: int | None = None, prompt_lens=None, ids=None,
                 watermark_key: int | None = None):
        install_shim()
        from vllm.v1.worker.gpu.sample.sampler import Sampler
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
        from vllm.v1.worker.gpu.states import RequestState

        B = len(sps)
        maxr = maxr or max(8, B)
        self.vocab, self.k = vocab, k
        self.req_states = RequestState(maxr, MAXLEN, max(4096, maxr * (k + 1)), k, vocab, DEV)
        kw = dict(max_num_reqs=maxr, vocab_size=vocab, device=DEV, req_states=self.req_states,
                  num_speculative_tokens=k)
        if "vllm_config" in inspect.signature(Sampler).parameters:
            from vllm.config import DeviceConfig, VllmConfig

            kw["vllm_config"] = VllmConfig(device_config=DeviceConfig(device="cpu"))
        spec = SimpleNamespace(num_speculative_tokens=k, rejection_sample_method="standard",
                               synthetic_acceptance_rates=None, enable_adaptive_verification=False,
                               fly_window_size=None, fly_entropy_threshold=0.0, fly_entropy_top_k=0)
        if watermark_key is None:
            self.sampler = Sampler(**kw)
            self.rejection_sampler = RejectionSampler(self.sampler, spec, DEV)
        else:  # as the 0.33 V2 model runner builds a watermarking sampler with a drafter
            from vllm.config.watermarking import WatermarkConfig
            from vllm.v1.watermarking import create_watermarker
            from vllm.v1.watermarking.gpu_sampler import GPUWatermarkSampler
            from vllm.v1.watermarking.spec_decode import (create_speculative_target_watermarker,
                                                          speculative_target_watermark_key)

            wm = WatermarkConfig(key=watermark_key)
            self.sampler = GPUWatermarkSampler(create_speculative_target_watermarker(create_watermarker(wm)),
                                               deduplicate_contexts=wm.deduplicate_contexts,
                                               deduplicate_contexts_max_history=wm.deduplicate_contexts_max_history,
                                               **kw)
            self.rejection_sampler = RejectionSampler(self.sampler, spec, DEV,
                                                      watermark_key=speculative_target_watermark_key(wm))
        self.ids = ids or [f"req{i}" for i in range(B)]
        self.prompt_lens = list(prompt_lens or [5] * B)
        self._two_arg = "prompt_len" not in inspect.signature(self.sampler.add_request).parameters
        for rid, sp, P in zip(self.ids, sps, self.prompt_lens):
            self.req_states.add_request(rid, P, list(range(1, P + 1)), P, 64)
            self._add(self.req_states.req_id_to_index[rid], P, sp)
        self.req_states.apply_staged_writes()
        self.sampler.apply_staged_writes()
        self.runner = SimpleNamespace(sampler=self.sampler, rejection_sampler=self.rejection_sampler,
                                      req_states=self.req_states, structured_outputs_worker=None,
                                      device=DEV, max_num_reqs=maxr,
                                      speculative_config=SimpleNamespace(num_speculative_tokens=k))

    def _add(self, idx, P, sp):
        if self._two_arg:
            self.sampler.add_request(idx, sp)
        else:
            self.sampler.add_request(idx, P, sp)

    def readd(self, sps):
        """New sampling parameters (and, for unseeded ones, new random seeds) for the same slots:
        what add_request does for a new request in a freed slot."""
        for rid, sp, P in zip(self.ids, sps, self.prompt_lens):
            self._add(self.req_states.req_id_to_index[rid], P, sp)
        self.sampler.apply_staged_writes()

    def batch(self, drafts, roots, gen):
        """The InputBatch fields the hook and vLLM's samplers read (the runner's layout)."""
        B = len(drafts)
        counts = np.asarray([len(d) + 1 for d in drafts])
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        T = int(cu[-1])
        idx = np.asarray([self.req_states.req_id_to_index[r] for r in self.ids[:B]], dtype=np.int32)
        input_ids = torch.zeros(T, dtype=torch.int64)
        positions = torch.zeros(T, dtype=torch.int64)
        for r in range(B):
            input_ids[cu[r]] = roots[r]
            if len(drafts[r]):
                input_ids[cu[r] + 1: cu[r + 1]] = torch.as_tensor(list(drafts[r]), dtype=torch.int64)
            positions[cu[r]: cu[r + 1]] = self.prompt_lens[r] + gen[r] + torch.arange(int(counts[r]))
        seq_lens = (positions[torch.from_numpy(cu[1:] - 1).long()] + 1).to(torch.int32)
        return SimpleNamespace(
            req_ids=list(self.ids[:B]), num_reqs=B, num_draft_tokens=int(counts.sum() - B),
            idx_mapping=torch.from_numpy(idx), idx_mapping_np=idx,
            expanded_idx_mapping=torch.from_numpy(np.repeat(idx, counts)),
            expanded_local_pos=torch.from_numpy(np.concatenate([np.arange(c) for c in counts]).astype(np.int32)),
            cu_num_logits=torch.from_numpy(cu), cu_num_logits_np=cu, logits_indices=torch.arange(T),
            input_ids=input_ids, positions=positions, seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=seq_lens.clone())


# ==== statistics ================================================================================
def chi2_pvalue(counts, p) -> float:
    """Pearson chi-square p-value of counts against probabilities p (cells with p == 0 and a
    count fail outright; cells are pooled until every expected count is >= 5)."""
    counts = np.asarray(counts, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    if ((p == 0) & (counts > 0)).any():
        return 0.0
    keep = p > 0
    c, e = counts[keep], p[keep] * counts.sum()
    order = np.argsort(e)
    c, e = c[order], e[order]
    cc, ee, acc_c, acc_e = [], [], 0.0, 0.0
    for ci, ei in zip(c, e):  # pool the smallest cells
        acc_c += ci
        acc_e += ei
        if acc_e >= 5:
            cc.append(acc_c)
            ee.append(acc_e)
            acc_c = acc_e = 0.0
    if acc_e and ee:
        cc[-1] += acc_c
        ee[-1] += acc_e
    cc, ee = np.asarray(cc), np.asarray(ee)
    if len(ee) < 2:
        return 1.0
    stat = float(((cc - ee) ** 2 / ee).sum())
    df = len(ee) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def shift_power(p, n: int, shift: float = 0.02, alpha: float = 1e-3, trials: int = 300, seed: int = 0) -> float:
    """Probability that chi2_pvalue(counts of n draws, p) < alpha when the true distribution is p
    with ``shift`` of probability moved between the two most likely cells (the hardest single
    transfer to see): the test's power against a 2% shift, by simulation."""
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    i, j = np.argsort(p)[::-1][:2]
    q = p.copy()
    d = min(shift, q[i])
    q[i] -= d
    q[j] += d
    g = np.random.default_rng(seed)
    hits = sum(chi2_pvalue(g.multinomial(n, q), p) < alpha for _ in range(trials))
    return hits / trials


def log(*a):
    print(*a, flush=True)
    sys.stdout.flush()


__all__ = ["DEV", "MAXLEN", "RESULTS", "check", "env", "V1World", "V2World", "v1_spec_metadata",
           "chi2_pvalue", "shift_power", "log", "math"]
