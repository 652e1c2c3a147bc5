"""Side by side: the PLIF scan of commit 2b1f004 (one-step backward) against the working tree's."""
import json
import sys

sys.path.insert(0, ".")
import torch

sys.path.append("bench")
import _plif_old
from kernels import plif


def time_ms(fn, budget_s):
    import statistics, time
    fn(); torch.cuda.synchronize()
    timings, started = [], time.perf_counter()
    while len(timings) < 3 or (len(timings) < 50 and time.perf_counter() - started < budget_s):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(); fn(); end.record(); end.synchronize()
        timings.append(begin.elapsed_time(end))
    return statistics.median(timings)

for batch, steps in [(8, 4096), (1, 32768)]:
    x = torch.randn(batch, steps, 2560, device="cuda")
    beta = torch.rand(2560, device="cuda") * 0.8 + 0.1
    th = torch.rand(2560, device="cuda") + 0.5
    leaves = [x.requires_grad_(), beta.requires_grad_(), th.requires_grad_()]
    grads = [torch.randn_like(x), torch.randn_like(x)]
    for repeat in range(2):
        for name, module in [("old", _plif_old), ("new", plif)]:
            def both(module=module):
                spikes, v_pre, _ = module.plif_scan(*leaves)
                torch.autograd.grad([spikes, v_pre], leaves, grads)
            with torch.no_grad():
                fwd = time_ms(lambda module=module: module.plif_scan(x, beta, th), budget_s=0.3)
            total = time_ms(both, budget_s=0.5)
            print(json.dumps({"Bt": batch, "T": steps, "impl": name, "repeat": repeat, "fwd_ms": round(fwd, 4),
                              "fwd_bwd_ms": round(total, 4), "bwd_ms": round(total - fwd, 4)}), flush=True)
