"""The Triton kernels of `kernels.relay` (imported only where triton is installed; module level,
so the interpreter finds the helpers they call)."""

import triton
import triton.language as tl


@triton.jit
def slot(posts, layer, L, R):
    """(step, ring slot) of `layer` in the running step: its router has posted."""
    step = (tl.load(posts) - 1) // L
    return step, (step % R) * L + layer


@triton.jit
def wait(flag, step, status, SPINS):
    """Poll `flag` until it holds `step` (True), or until ABORT or SPINS polls (False)."""
    seen = tl.atomic_load(flag, sem="acquire", scope="sys")
    stop = tl.atomic_load(status + 2, sem="relaxed", scope="sys")  # ABORT
    n = 0
    while (seen != step) & (stop == 0) & (n < SPINS):
        seen = tl.atomic_load(flag, sem="acquire", scope="sys")
        stop = tl.atomic_load(status + 2, sem="relaxed", scope="sys")
        n += 1
    return seen == step


@triton.jit(do_not_specialize=["layer"])
def post(x, index, weights, posts, rx, rindex, rweights, xseq, layer, L, R, H, K, SH, SK,
         BH: tl.constexpr, BK: tl.constexpr):
    """H, K: the call's numbers of hidden values and routed positions (all rows); SH, SK: a ring slot's."""
    step, at = slot(posts, layer, L, R)
    for h in range(0, H, BH):
        c = h + tl.arange(0, BH)
        m = c < H
        tl.store(rx + at * SH + c, tl.load(x + c, mask=m), mask=m)
    k = tl.arange(0, BK)
    mk = k < K
    tl.store(rindex + at * SK + k, tl.load(index + k, mask=mk).to(tl.int64), mask=mk)
    tl.store(rweights + at * SK + k, tl.load(weights + k, mask=mk).to(tl.float64), mask=mk)
    tl.debug_barrier()  # every thread's stores happen before the release below
    tl.atomic_store(xseq + at, step, sem="release", scope="sys")


@triton.jit(do_not_specialize=["layer"])
def keep(index, weights, posts, on_host, dseq, status, kept, skip, fell, hrow, hids, layer, L, R, E, K, SPINS,
         BK: tl.constexpr, HAS_ROWS: tl.constexpr):
    """HAS_ROWS (a disk tier): also each position's host-cache row (`hrow`) into `hids`; then a decision
    that does not come cannot be done without (no row is known): the weights become NaN, a failure."""
    step, at = slot(posts, layer, L, R)
    ok = wait(dseq + at, step, status, SPINS)
    k = tl.arange(0, BK)
    mk = k < K
    e = tl.load(index + k, mask=mk, other=0).to(tl.int64)
    flag = tl.load(on_host + at * E + e, mask=mk, other=0, volatile=True) * ok.to(tl.uint8)  # 0: not ok
    h = flag != 0  # the host CPU (1) or a twin (2) serves it
    w = tl.load(weights + k, mask=mk)
    if HAS_ROWS:
        r = tl.load(hrow + at * E + e, mask=mk, other=0, volatile=True)
        tl.store(hids + k, tl.maximum(r, 0).to(tl.int64), mask=mk)
        w = tl.where(ok, w, float("nan"))
    tl.store(kept + k, tl.where(h, 0.0, w), mask=mk)
    tl.store(skip + k, flag.to(tl.int8), mask=mk)
    tl.store(fell, 1 - ok.to(tl.int32))
    if not ok:
        if HAS_ROWS:
            tl.atomic_add(status + 1, 1, scope="sys")  # FAILURES
        else:
            tl.atomic_add(status + 0, 1, scope="sys")  # FALLBACKS


@triton.jit(do_not_specialize=["layer"])
def add(out, host_out, posts, oseq, status, fell, layer, L, R, H, SH, SPINS, BH: tl.constexpr):
    if tl.load(fell) == 0:  # else the step computed every routed expert itself
        step, at = slot(posts, layer, L, R)
        if wait(oseq + at, step, status, SPINS):
            for h in range(0, H, BH):
                c = h + tl.arange(0, BH)
                m = c < H
                o = tl.load(out + c, mask=m)
                v = tl.load(host_out + at * SH + c, mask=m, volatile=True)  # no cached copy of an earlier step's
                tl.store(out + c, o + v.to(o.dtype), mask=m)
        else:
            tl.atomic_add(status + 1, 1, scope="sys")  # FAILURES
            for h in range(0, H, BH):
                c = h + tl.arange(0, BH)
                tl.store(out + c, tl.full((BH,), float("nan"), tl.float32), mask=c < H)
