"""The engine on a CUDA device: copies on the copy stream are waited for, lossless policies match
transformers on the same device, bundle experts dequantized on the device match the host's, pinned
host tiers are pinned, and the allocator's real peak stays inside the budget.

Every test here needs a CUDA device and is skipped with that reason where there is none (CI).
Run them on a GPU machine with `pytest -m cuda` (scripts/gpu_check.sh runs them with the benchmarks).
"""

import gc

import pytest
import torch

from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.engine.transfer import Copier
from moetool.model import attention_for_decode, load_model, load_reference
from moetool.quant.bundle import Bundle
from moetool.run import RunConfig, prepare, run
from tiny import DequantProvider

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
if torch.cuda.is_available():
    # The attention kernels load_model picks on CUDA, for the reference models too (same kernels, same logits).
    attention_for_decode("cuda")

IDS = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7], [1, 2, 3, 4, 5, 6, 7, 8]])
CUDA = torch.device("cuda")
# ~10 ms of spinning at H100 clocks: long enough that a kernel not ordered after a copy reads the
# slot before the copy lands, short enough to keep the suite quick.
SLEEP_CYCLES = 20_000_000


@pytest.fixture
def slow_copies(monkeypatch):
    """Every engine copy starts only after the copy stream has spun for a while, so a compute kernel
    that does not wait for its copy's event reads a stale slot (wrong logits, not a flaky pass)."""
    copy = Copier.copy

    def slow(self, dst, src):
        if self.cuda:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(SLEEP_CYCLES)
        return copy(self, dst, src)

    monkeypatch.setattr(Copier, "copy", slow)


def test_copier_orders_copies_after_queued_reads_and_before_waiting_kernels():
    copier = Copier(CUDA)
    slot = torch.full((1 << 20,), 1, dtype=torch.uint8, device=CUDA)
    new = torch.full((1 << 20,), 7, dtype=torch.uint8).pin_memory()
    # A read of the slot queued on the compute stream behind a long kernel: the copy must not overwrite
    # the slot before that read has run (an evicted expert's last use).
    torch.cuda._sleep(SLEEP_CYCLES)
    before = slot.sum(dtype=torch.int64)
    event = copier.copy(slot, new)
    assert isinstance(event, torch.cuda.Event)
    copier.wait(event)
    after = slot.sum(dtype=torch.int64)  # queued on the compute stream after the wait: sees the copy
    torch.cuda.synchronize()
    assert int(before) == slot.numel() and int(after) == 7 * slot.numel()
    assert Copier.done(event)


def test_copier_reports_a_copy_in_flight_without_waiting_for_it():
    copier = Copier(CUDA)
    dst = torch.empty(1 << 20, dtype=torch.uint8, device=CUDA)
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8).pin_memory()
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    event = copier.copy(dst, src)
    assert not Copier.done(event)  # non-blocking query while the copy stream is still spinning
    event.synchronize()
    assert Copier.done(event) and torch.equal(dst.cpu(), src)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("policy,budget,settings", [
    ("resident", "100%", {}), ("lod", "10%", {}), ("lru", "10%", {}), ("lru", "50%", {}), ("eap", "25%", {}),
    ("fate", "30%", {"cache_bits": "16", "low_bits": "16"})])
def test_lossless_policies_match_transformers_on_cuda(tiny_ckpt, slow_copies, arch, policy, budget, settings, impl):
    """fp32 on the device: prefill logits and 10 greedy tokens equal transformers' own model on the
    same device with the same experts kernel, while every copy is slowed down."""
    path = tiny_ckpt(arch)
    ref = load_reference(path, experts_impl=impl).to(CUDA)
    ids, mask = IDS.to(CUDA), torch.ones_like(IDS, device=CUDA)
    with torch.no_grad():
        want_logits = ref(ids).logits
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    lm = load_model(path, device=CUDA)
    engine, plan = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), policy, settings=settings,
                                budget=budget, device=CUDA, batch=2, experts_impl=impl)
    with torch.no_grad():
        got_logits = lm.model(ids).logits
    assert torch.equal(got_logits, want_logits), f"max diff {(got_logits - want_logits).abs().max():.3g}"
    got = lm.model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    s = engine.stats.summary()
    assert s["peak_device_bytes"] <= plan.total_bytes
    if policy in ("lod", "lru") and budget != "100%":
        assert s["bytes_h2d"] > 0  # the misses really went through the copy stream


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("bits,budget,policy", [(4, "100%", "static"), (2, "100%", "static"),
                                                (4, "30%", "lru"), (16, "30%", "lru")])
def test_bundle_experts_dequantized_on_the_device_match_the_host(tiny_ckpt, bundle, slow_copies, bits, budget, policy,
                                                                  impl):
    path = str(tiny_ckpt("qwen2_moe"))
    ready = prepare(RunConfig(model=path, bundle=bundle, policy=policy, settings={"bits": str(bits)}, budget=budget,
                              device="cuda", dtype="float32", experts_impl=impl), batch=2)
    opened = Bundle.open(bundle, model=ready.lm.fingerprint)
    ref = load_model(path, provider=DequantProvider(opened, bits))  # dequantized on the host, computed there
    with torch.no_grad():
        got = ready.lm.model(IDS.to(CUDA)).logits.cpu()
        want = ref.model(IDS).logits
    # Same dequantized numbers; the GEMMs are cuBLAS's against the CPU's, so not bit for bit.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    store = ready.engine.store
    assert store.tiers and store.page_lock and store.pinned_bytes > 0
    assert all(t.is_pinned() for t in store._pinned.values()) and store.ring.buf.is_pinned()


def test_a_host_budget_too_small_to_pin_stages_through_the_pinned_ring(tiny_ckpt, bundle, slow_copies):
    path = str(tiny_ckpt("qwen2_moe"))
    runs = {}
    for host_budget in (None, "4KiB"):  # 4 KiB: the ring (top-k 4-bit blobs) and one pinned blob
        cfg = RunConfig(model=path, bundle=bundle, policy="lru", settings={"bits": "4"}, budget="30%", device="cuda",
                        dtype="float32", host_budget=host_budget, prompts=("abcdefgh", "the cat sat"),
                        max_new_tokens=8)
        runs[host_budget] = run(cfg)
    pinned, staged = runs[None], runs["4KiB"]
    assert staged.summary["host_staged_bytes"] > 0 and staged.summary["host_pinned_bytes"] <= 4 << 10
    assert pinned.summary["host_staged_bytes"] == 0
    assert staged.tokens == pinned.tokens


@pytest.mark.parametrize("policy,settings,budget", [
    ("lru", {}, "25%"), ("static", {"bits": "4"}, "50%"),  # every expert at 4 bits: 37.5% of the bf16 bytes ("dymoe", {"high_bits": "4", "low_bits": "0"}, "25%"),
    ("dymoe", {"high_bits": "4", "low_bits": "2"}, "25%"), ("smoe", {}, "25%"), ("fate", {}, "25%"),
    ("dynaexq", {}, "50%"),  # it keeps every expert at b_lo = 4 bits
    ("eap", {}, "25%"), ("lod", {}, "25%"), ("resident", {}, "100%")])
def test_every_policy_runs_on_cuda_within_the_budget_the_allocator_sees(tiny_ckpt, bundle, policy, settings, budget):
    """bf16 on the device (the default there): the run completes, and both the ledger and torch's own
    allocator peak (model, KV, pools, staging, dequant scratch, cuBLAS workspace; less what the
    process held before the engine) stay inside the budget."""
    gc.collect()  # earlier tests' engines and models hold device memory until their cycles are collected
    torch.cuda.empty_cache()
    out = run(RunConfig(model=str(tiny_ckpt("qwen2_moe")), bundle=bundle, policy=policy, settings=settings,
                        budget=budget, device="cuda", prompts=("abcdefgh", "the quick brown fox"), max_new_tokens=12))
    assert all(len(t) == 12 for t in out.tokens)
    assert out.peak_device_bytes <= out.budget_bytes
    assert 0 < out.summary["peak_allocated_bytes"] <= out.budget_bytes, \
        f"allocator peak {out.summary['peak_allocated_bytes']} > budget {out.budget_bytes} ({out.budget})"


@pytest.mark.parametrize("policy,budget,settings", [("resident", "100%", {}), ("lru", "50%", {}),
                                                    ("static", "100%", {"bits": "4"}), ("lru", "30%", {"bits": "2"})])
def test_a_decode_step_waits_for_the_device_once_per_moe_layer(tiny_ckpt, bundle, policy, budget, settings):
    """The layer's routing and router logits come to the host in one transfer, and index uploads go
    through pinned memory: torch's sync debug mode sees at most one synchronizing call per MoE layer."""
    import warnings

    path = str(tiny_ckpt("qwen2_moe"))
    ready = prepare(RunConfig(model=path, bundle=bundle, policy=policy, settings=settings, budget=budget,
                              device="cuda"), batch=1)
    model, layers = ready.lm.model, len(ready.lm.geometry.layers)
    cache = None
    nxt = IDS[:1].to(CUDA)
    with torch.no_grad():
        for _ in range(3):  # prefill and two decode steps: first-use allocations and loads settle
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(4):
                    out = model(nxt, past_key_values=cache, use_cache=True)
                    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites = sorted({f"{w.filename}:{w.lineno}" for w in syncs})
    assert len(syncs) <= 4 * layers, f"{len(syncs) / 4:g} syncs a step over {layers} MoE layers, at {sites}"


def test_the_wall_clock_counts_the_time_compute_waits_for_its_copies(tiny_ckpt, slow_copies):
    """On CUDA the host never blocks on a copy, so a stall is timed on the device: events on each
    side of the compute stream's wait. Every copy here comes ~10 ms late: load-on-demand stalls,
    `resident` (nothing to load after its warm-up) does not."""
    stalls = {}
    for policy, budget in (("lod", "10%"), ("resident", "100%")):
        lm = load_model(tiny_ckpt("qwen2_moe"), device=CUDA)
        engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), policy, budget=budget,
                                 device=CUDA, clock="wall")
        lm.model.generate(IDS[:1].to(CUDA), max_new_tokens=4, do_sample=False)
        stalls[policy] = engine.stats.summary()["stall_s"]
    assert stalls["resident"] == 0.0
    assert stalls["lod"] > 0.005, stalls


def test_smoe_cpu_assisted_experts_run_while_the_device_computes(tiny_ckpt, monkeypatch):
    """SMoE at alpha = 0 (no substitution) runs exactly the routed experts, misses split between
    loads and the host (Algorithm 2): the same tokens as transformers on the device, with experts
    really run on the host. Each device expert is slowed by ~10 ms on the compute stream; when a
    host expert starts in a layer that gave the device experts, that work must still be pending:
    the rows came to the host in their own copy and the device was given its experts first (not
    after the host's, nor behind a sync on the device's work)."""
    from moetool.engine import runtime

    path = tiny_ckpt("qwen2_moe")
    ref = load_reference(path, experts_impl="grouped_mm").to(CUDA)
    lm = load_model(path, device=CUDA)
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "smoe",
                             settings={"alpha": "0"}, budget="10%", device=CUDA)
    queued, busy = [False], []  # device experts queued in this layer call; at each host expert: still working?
    grouped, forward = runtime.grouped_mlp, runtime.EngineExperts.expert_forward
    run_layer, host_blob = engine.run_layer, engine.store.host

    def slow(fn):
        def call(module, x, *a, **kw):
            if x.is_cuda:  # a device expert (the host's run on CPU rows)
                torch.cuda._sleep(SLEEP_CYCLES)
                queued[0] = True
            return fn(module, x, *a, **kw)
        return call

    def layer_call(*a, **kw):
        queued[0] = False
        return run_layer(*a, **kw)

    def host(*a, **kw):
        if queued[0]:
            busy.append(not torch.cuda.current_stream(CUDA).query())
        return host_blob(*a, **kw)

    monkeypatch.setattr(runtime, "grouped_mlp", slow(grouped))
    monkeypatch.setattr(runtime.EngineExperts, "expert_forward", slow(forward))
    monkeypatch.setattr(engine, "run_layer", layer_call)
    monkeypatch.setattr(engine.store, "host", host)
    ids = IDS[:1].to(CUDA)
    want = ref.generate(ids, max_new_tokens=8, do_sample=False)
    got = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert engine.stats.summary()["cpu_experts"] > 0 and busy
    assert all(busy), f"the device was idle at {len(busy) - sum(busy)} of {len(busy)} host experts"


# ---- the captured decode step (engine/decode.py) ---------------------------------------------------

@pytest.mark.parametrize("policy,settings,budget", [("resident", {}, "100%"), ("lru", {}, "25%"),
                                                     ("fate", {"cache_bits": "16", "low_bits": "16", "p": "0"}, "30%"),
                                                     ("dymoe", {"config": "4/2"}, "40%"), ("static", {"bits": "4"}, "100%")])
def test_the_captured_step_is_one_graph_replay_without_a_host_sync(tiny_ckpt, bundle, slow_copies, policy, settings,
                                                                    budget):
    """On CUDA the step is captured as one CUDA graph; replaying it (and copying its log out) makes
    no blocking host sync (torch's sync debug mode raises on one); its fills, slowed down, never
    corrupt a slot the queued step reads (tokens equal the host path's); the allocator stays within
    the budget."""
    from moetool.engine.decode import DecodeProgram

    ids = IDS[:1]
    want = None
    for captured in (False, True):
        lm = load_model(tiny_ckpt("qwen2_moe"), device=CUDA, dtype=torch.bfloat16)
        store = HostStore.from_bundle(Bundle.open(bundle, model=lm.fingerprint), torch.bfloat16)
        engine, plan = build_engine(lm, store, policy, settings=settings, budget=budget, device=CUDA, captured=captured,
                                    max_tokens=32)
        if not captured:
            with torch.no_grad():
                want = lm.model.generate(ids.to(CUDA), max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
            engine.close()
            continue
        program = DecodeProgram(engine, max_tokens=32)
        assert program.summary()["cuda_graph"]
        got = program.generate(ids, 6)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.capturing = True
            program._launch()  # one replay: raises if anything in it synchronizes with the host
            for name, t in program.layers.log.tensors().items():
                program.host_logs[0][name].copy_(t, non_blocking=True)
        finally:
            engine.capturing = False
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        s = engine.stats.summary()
        assert s["peak_allocated_bytes"] <= plan.total_bytes
        if policy in ("resident", "lru", "fate"):  # lossless: the host path's greedy tokens
            assert got == want


def test_a_missed_expert_is_read_from_pinned_host_memory_in_place():
    """The zero-copy read the captured step relies on: a kernel reads pinned host rows by index."""
    from moetool.engine.zero_copy import host_rows, unavailable

    assert unavailable(CUDA) is None
    src = torch.randint(0, 255, (8, 256), dtype=torch.uint8).pin_memory()
    got = host_rows(src, torch.tensor([5, -1, 2], device=CUDA))
    assert got.is_cuda
    assert torch.equal(got.cpu(), torch.stack([src[5], torch.zeros(256, dtype=torch.uint8), src[2]]))


def test_missed_rows_writes_only_the_marked_rows_on_the_gpu():
    """`missed_rows` (a fused kernel's pool of missed experts): marked rows from pinned host memory,
    a row marked -1 left unwritten (the kernel never reads it)."""
    from moetool.engine.zero_copy import missed_rows

    src = torch.randint(0, 255, (8, 256), dtype=torch.uint8).pin_memory()
    got = missed_rows(src, torch.tensor([5, -1, 2], device=CUDA)).cpu()
    assert torch.equal(got[0], src[5]) and torch.equal(got[2], src[2])


@pytest.mark.parametrize("arch", ["gpt_oss", "cohere2_moe"])
def test_a_sliding_window_model_replays_one_graph_past_its_window(tmp_path, arch):
    """One CUDA graph serves every position of a sliding-window model (its cache layers kept whole):
    past the window (16) its tokens are the host path's on the same device."""
    from moetool.engine.decode import DecodeProgram
    from tiny import save_tiny

    ckpt = save_tiny(arch, tmp_path / arch)
    ids = IDS[:1]
    got = {}
    for captured in (False, True):
        lm = load_model(ckpt, device=CUDA)
        engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "resident", budget="100%",
                                 device=CUDA, captured=captured, max_tokens=40)
        if not captured:
            with torch.no_grad():
                got[captured] = lm.model.generate(ids.to(CUDA), max_new_tokens=24, min_new_tokens=24,
                                                  do_sample=False)[0, ids.shape[1]:].tolist()
            engine.close()
            continue
        program = DecodeProgram(engine, max_tokens=40)
        assert program.summary()["cuda_graph"]
        got[captured] = program.generate(ids, 24)
    assert got[True] == got[False]


def test_a_gather_reads_hits_from_the_device_pool_and_misses_from_pinned_host_memory():
    """`blob_rows` on CUDA: a hit's blob from its device slot (slots wider than the blob), a miss's
    over the bus from the pinned mirror (strided rows, as a shard's), a row marked in neither zeros."""
    from moetool.engine.zero_copy import blob_rows

    src = torch.randint(0, 255, (6, 256), dtype=torch.uint8).pin_memory()[:, :192]
    pool = torch.randint(0, 255, (4, 256), dtype=torch.uint8, device=CUDA)
    slot = torch.tensor([2, -1, -1, 0, 3, -1], device=CUDA)
    index = torch.tensor([-1, 5, -1, -1, 1, 0], device=CUDA)  # row 4 marked in both: the miss wins
    got = blob_rows(pool, slot, src, index)
    host_pool, zero = pool.cpu(), torch.zeros(192, dtype=torch.uint8)
    want = torch.stack([host_pool[2, :192], src[5], zero, host_pool[0, :192], src[1], src[0]])
    assert got.is_cuda and torch.equal(got.cpu(), want)


def test_run_takes_the_captured_path_on_cuda_by_default(tiny_ckpt):
    result = run(RunConfig(model=str(tiny_ckpt("qwen2_moe")), policy="lru", budget="50%", device="cuda",
                           prompts=("hello",), max_new_tokens=4))
    assert result.summary["path"] == "captured" and result.summary["cuda_graph"]


# (bits, group, hidden, width, T, k): the real Triton kernels, compiled for this GPU, against the fp32
# dequantize reference on the host. Widths that are not a multiple of the K tile (1408, 768) or are
# under it (32); every precision at each group size.
GPU_KERNEL_CASES = [(16, 0, 2048, 1408, 1, 4), (16, 0, 256, 32, 5, 8), (8, 128, 2048, 768, 1, 8), (8, 32, 256, 96, 3, 6),
                    (4, 64, 2048, 1408, 1, 4), (4, 128, 2048, 768, 2, 8), (4, 32, 256, 32, 8, 3),
                    (2, 64, 2048, 1408, 1, 4), (2, 128, 2048, 768, 1, 8), (2, 32, 256, 96, 4, 5)]


@pytest.mark.parametrize("bits,group,hidden,width,T,k", GPU_KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_experts_kernels_on_the_gpu_match_the_dequantize_reference(bits, group, hidden, width, T, k, dtype):
    from kernel_cases import RTOL, random_ids, random_pool, reference_forward

    from moetool.kernels import Act, Activation, SlotPool, experts_forward

    silu = Activation(Act.SILU, gated=True)
    gen = torch.Generator().manual_seed(bits * 100 + T)
    pool = random_pool(bits, hidden, width, group, slots=k + 3, gen=gen)
    pool = SlotPool(pool.data, pool.layout, random_ids(T, k, k + 3, gen).contiguous())
    x, w = torch.randn(T, hidden, generator=gen).to(dtype), torch.rand(T, k, generator=gen).to(dtype)
    want = reference_forward(x.float(), w.float(), [pool], silu)
    on_gpu = SlotPool(pool.data.to(CUDA), pool.layout, pool.ids.to(CUDA))
    got = experts_forward(x.to(CUDA), w.to(CUDA), [on_gpu], silu).cpu()
    assert got.dtype == dtype and got.shape == (T, hidden)
    # bf16 output: one rounding of each value (2^-8) on top of the fp32 tolerance.
    tol = RTOL * want.abs().max() + (2 ** -8 * want.abs() if dtype == torch.bfloat16 else 0)
    assert ((got.float() - want).abs() <= tol).all(), f"max error {(got.float() - want).abs().max():.3g}"


@pytest.mark.parametrize("bits,group,hidden,width,T,k", [GPU_KERNEL_CASES[i] for i in (0, 2, 4, 6, 7, 9)])
@pytest.mark.parametrize("mode", [1, 2, 3])
def test_each_loop_mode_on_the_gpu_matches_the_dequantize_reference(bits, group, hidden, width, T, k, mode):
    """The loop modes the tuner may pick (`kernels.config.MODES`), compiled for this GPU, in bf16,
    mode 3 at its own tiles (its tolerance: tests/test_triton_experts.py's RTOL_WORDS)."""
    from kernel_cases import RTOL, random_ids, random_pool, reference_forward

    from moetool.kernels import Act, Activation, SlotPool, experts_forward
    from moetool.kernels.config import mode_tiles

    silu = Activation(Act.SILU, gated=True)
    gen = torch.Generator().manual_seed(bits * 100 + T + mode)
    pool = random_pool(bits, hidden, width, group, slots=k + 3, gen=gen)
    pool = SlotPool(pool.data, pool.layout, random_ids(T, k, k + 3, gen).contiguous())
    x, w = torch.randn(T, hidden, generator=gen).bfloat16(), torch.rand(T, k, generator=gen).bfloat16()
    want = reference_forward(x.float(), w.float(), [pool], silu)
    on_gpu = SlotPool(pool.data.to(CUDA), pool.layout, pool.ids.to(CUDA))
    config = (*mode_tiles(mode, torch.device("cuda")), mode)
    got = experts_forward(x.to(CUDA), w.to(CUDA), [on_gpu], silu, config).cpu().float()
    tol = (1e-4 if mode == 3 else RTOL) * want.abs().max() + 2 ** -8 * want.abs()
    assert ((got - want).abs() <= tol).all(), f"max error {(got - want).abs().max():.3g}"


def test_the_fused_experts_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs written in place: the kernels read their slot ids and
    rows from the device each replay (no value of them is baked into the graph)."""
    from kernel_cases import random_ids, random_pool

    from moetool.kernels import Act, Activation, SlotPool, experts_forward

    silu = Activation(Act.SILU, gated=True)
    gen = torch.Generator().manual_seed(7)
    pool = random_pool(4, 2048, 1408, 64, slots=8, gen=gen)
    ids = random_ids(1, 4, 8, gen).to(CUDA)
    gpu = SlotPool(pool.data.to(CUDA), pool.layout, ids)
    x = torch.randn(1, 2048, generator=gen).bfloat16().to(CUDA)
    w = torch.rand(1, 4, generator=gen).bfloat16().to(CUDA)
    experts_forward(x, w, [gpu], silu)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward(x, w, [gpu], silu)
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        ids.copy_(random_ids(1, 4, 8, g))
        x.copy_(torch.randn(1, 2048, generator=g).bfloat16())
        graph.replay()
        assert torch.equal(out, experts_forward(x, w, [gpu], silu))
