"""Which part of a replayed call costs more on CUDA than the hand-written loop, bursts and pipelined."""
import collections, json, statistics, sys, time
sys.path.insert(0, "benchmarks")
import torch
import host_cost
import graphstep.profiling as profiling
import graphstep.lifecycle as lifecycle_mod
capture_mod = sys.modules['graphstep.capture']
from graphstep.signature import Signature

step, args = host_cost.tiny_gpt("cuda")
for _ in range(6): step(*args)
torch.cuda.synchronize()
life = next(iter(step._lives.values())); ctx = step._ctx
rec = life.current.recording
_, leaves = Signature.of(args, {})
bufs = life.inputs.tensors; out = rec.outputs
guard = life.current.guard
def launch():
    for p in rec.parts: p()
def hand():
    for b, t in zip(bufs, leaves):
        if t is not b: b.copy_(t)
    launch(); return out.clone()
def py_work():
    Signature.of(args, {}); ctx.optim.before_call(); life.plan()
def py_then_hand():
    py_work(); return hand()
def hand_then_py():
    r = hand(); py_work(); return r
def whole(): return step(*args)
def gs_stages():  # graphstep's own stage functions, composed without the dispatch
    s, lv = Signature.of(args, {}); ctx.optim.before_call(); life.plan()
    life.inputs.load(lv); o = rec.replay(args, {}); return life.deliver(o)

def burst_us(fn):
    meds = []
    for r in range(9):
        torch.cuda.synchronize(); fn(); fn()
        ts = []
        for _ in range(10):
            t0 = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t0)
        meds.append(statistics.median(ts) / 1e3)
    torch.cuda.synchronize()
    return round(min(meds), 1)
def pipe_us(fn, n=100):
    res = []
    for r in range(3):
        torch.cuda.synchronize(); ts = []
        for _ in range(n):
            t0 = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize(); res.append(statistics.median(ts) / 1e3)
    return round(min(res), 1)

profiling._nvtx_available = False
fns = dict(hand=hand, py_work=py_work, whole=whole, gs_stages=gs_stages)
print("burst", json.dumps({k: burst_us(f) for k, f in fns.items()}))
print("pipe", json.dumps({k: pipe_us(f) for k, f in fns.items()}))
parts = dict(
  modules=guard.modules.holds, reads=guard.reads.holds, optimizers=guard.optimizers.holds,
  fast=(guard.fast.holds if guard.fast is not None else (lambda: None)),
  grads=lambda: all(map(__import__("operator").is_, map(lambda p: p.grad, guard.grad_params), guard.grads)),
  hand_plus_holds=lambda: (guard.holds(), hand()), hand_plus_fast=lambda: (guard.fast.holds(), hand()),
  hand_plus_reads=lambda: (guard.reads.holds(), hand()), hand_plus_opt=lambda: (guard.optimizers.holds(), hand()),
  hand_plus_mod=lambda: (guard.modules.holds(), hand()), hand_plus_sig=lambda: (Signature.of(args, {}), hand()))
print("guard parts burst", json.dumps({k: burst_us(f) for k, f in parts.items()}))
print("guard parts pipe", json.dumps({k: pipe_us(f) for k, f in parts.items()}))
print("n grad_params", len(guard.grad_params), "tensors", len(guard.tensors), "fresh", len(guard.fresh_grad_params))
# toggles
profiling._nvtx_available = False
life.current.guard = None
print("no-guard burst whole", burst_us(whole), "pipe", pipe_us(whole))
life.current.guard = guard
# timers inside the pipelined whole call
timers = collections.defaultdict(list)
def timed(name, f):
    def w(*a, **k):
        t0 = time.perf_counter_ns(); r = f(*a, **k); timers[name].append(time.perf_counter_ns() - t0); return r
    return w
orig = {}
Sig = capture_mod.Signature
orig_of = Sig.of
capture_mod.Signature = type("S", (), {"of": staticmethod(timed("signature", orig_of))})
life.plan = timed("plan", life.plan)
guard.holds = timed("guard.holds", guard.holds)
if guard.fast is not None:
    fh = guard.fast; 
    class F: pass
    ff = F(); ff.holds = timed("fast.holds", fh.holds); guard.fast = ff
life.inputs.load = timed("load", life.inputs.load)
rec.replay = timed("rec.replay", rec.replay)
life.deliver = timed("deliver", life.deliver)
ctx.optim.before_call = timed("before_call", ctx.optim.before_call)
life.replay = timed("life.replay", life.replay)
for mode, n in (("burst", 10), ("pipe", 100)):
    timers.clear()
    for r in range(5):
        torch.cuda.synchronize(); step(*args); step(*args)
        for _ in range(n):
            t0 = time.perf_counter_ns(); step(*args); timers["whole"].append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    print(mode, "stage medians us", json.dumps({k: round(statistics.median(v) / 1e3, 1) for k, v in timers.items()}))
print("gc", __import__("gc").get_threshold(), "cpu affinity", len(__import__("os").sched_getaffinity(0)))
step.close()
