"""Diagnostics (not committed): where graphstep's host time goes on CUDA; where GCN's extra memory goes."""
import cProfile, collections, json, os, pstats, subprocess, sys, time, statistics
sys.path.insert(0, "benchmarks")
import torch

def host():
    import host_cost
    from graphstep.signature import Signature
    step, args = host_cost.tiny_gpt("cuda")
    for _ in range(6): step(*args)
    torch.cuda.synchronize()
    life = next(iter(step._lives.values())); ctx = step._ctx
    rec = life.current.recording
    print("parts", len(rec.parts), "segments", len(rec.segments), "grads_after", len(rec.grads_after), "draws", len(rec.host_draws))
    _, leaves = Signature.of(args, {})
    bufs = life.inputs.tensors
    out = rec.outputs
    def launch():
        for p in rec.parts: p()
    def hand():
        for b, t in zip(bufs, leaves):
            if t is not b: b.copy_(t)
        launch(); return out.clone()
    def hand_noclone():
        for b, t in zip(bufs, leaves):
            if t is not b: b.copy_(t)
        launch(); return out
    stages = {
        "whole": lambda: step(*args), "hand": hand, "hand_noclone": hand_noclone, "launch": launch,
        "copy2": lambda: [b.copy_(t) for b, t in zip(bufs, leaves)], "clone": lambda: out.clone(),
        "signature": lambda: Signature.of(args, {}), "before_call": ctx.optim.before_call,
        "plan": life.plan, "load": lambda: life.inputs.load(leaves), "rec_replay": lambda: rec.replay(args, {}),
        "deliver": lambda: life.deliver(out),
    }
    res = {}
    for name, fn in stages.items():
        meds = []
        for r in range(7):
            torch.cuda.synchronize(); fn(); fn()
            ts = []
            for _ in range(10):
                t0 = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t0)
            meds.append(statistics.median(ts) / 1e3)
        res[name] = round(min(meds), 2)
    torch.cuda.synchronize()
    print("back-to-back us", json.dumps(res))
    # pipelined like the bench: 100 calls in a row, median host
    for name in ("whole", "hand", "hand_noclone"):
        fn = stages[name]; torch.cuda.synchronize(); ts = []
        for _ in range(100):
            t0 = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        print("pipelined100", name, round(statistics.median(ts) / 1e3, 1), "mean", round(statistics.mean(ts) / 1e3, 1))
    # CUDA API calls per call
    from torch.profiler import profile, ProfilerActivity
    for name in ("whole", "hand"):
        fn = stages[name]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20): fn()
        torch.cuda.synchronize()
        c = collections.Counter(e.name for e in prof.events())
        print("api per call", name, {k: v / 20 for k, v in c.most_common(40)})
    pr = cProfile.Profile()
    pr.enable()
    for i in range(3000):
        step(*args)
        if i % 10 == 9: torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    step.close()

def gcn_one(method):
    from graphstep.demo.bench_workloads import BuildContext
    from graphstep.demo.bench_models import gcn
    import graphstep
    GIB = 2**30
    wl = gcn(BuildContext(device=torch.device("cuda"), n_calls=40))
    fn = wl.make_step(wl.model)
    step = fn if method == "eager" else graphstep.capture(fn, model=wl.model, optimizer=wl.optimizer)
    out = {}
    for i in range(12):
        step(*wl.batches[0]); torch.cuda.synchronize()
        out[i] = (round(torch.cuda.memory_reserved() / GIB, 3), round(torch.cuda.max_memory_reserved() / GIB, 3),
                  round(torch.cuda.memory_allocated() / GIB, 3), round(torch.cuda.max_memory_allocated() / GIB, 3))
    segs = torch.cuda.memory_snapshot()
    bypool = collections.defaultdict(list)
    for s in segs:
        bypool[str(s.get("segment_pool_id"))].append(s["total_size"] // 2**20)
    print(method, "reserved/peak_reserved/alloc/peak_alloc per call", out)
    print(method, "segments MiB by pool", {k: sorted(v, reverse=True) for k, v in bypool.items()})
    if method != "eager": print(step.stats)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        gcn_one(sys.argv[1]); sys.exit()
    host()
    for m in ("eager", "graphstep"):
        subprocess.run([sys.executable, __file__, m], check=False)
