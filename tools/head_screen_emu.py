"""Lane-level emulation of kernels/lm_head.cu (quantize, screen, pick) against
gemv_kernel's greedy choice, in float32 with the kernels' summation orders and
index mappings: random heads, exact ties, NaN and inf weights, zero rows,
`valid` below the vocabulary, inputs scaled by 1e-3 and 1e3, and a planted
chunk-mapping error that must be caught. Check an index change to those
kernels here before spending device time (numpy; not run by CI).
    python3 tools/head_screen_emu.py [SEED]"""
import sys

import numpy as np
f32 = np.float32
def bf16(a):
    a = np.asarray(a, np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32)
def warp_sum(v):  # v [..., 32] float32, xor butterfly 16..1
    v = v.copy()
    for o in (16, 8, 4, 2, 1):
        idx = np.arange(32) ^ o
        v = (v + v[..., idx]).astype(np.float32)
    return v[..., 0]
def warp_max(v):
    v = v.copy()
    for o in (16, 8, 4, 2, 1):
        v = np.fmax(v, v[..., np.arange(32) ^ o])
    return v[..., 0]
def full_logits(W, x):  # prefetched_dot<8>: lane chunk c = elements lane*8 + 256c .. +8
    V, D = W.shape
    acc = np.zeros((V, 32), np.float32)
    for c in range(D // 256):
        for i in range(8):
            cols = np.arange(32) * 8 + 256 * c + i
            acc = (acc + W[:, cols] * x[cols]).astype(np.float32)  # fma: product exact for bf16*bf16
    return warp_sum(acc)
def order_key(f):
    b = np.asarray(f, np.float32).view(np.uint32).astype(np.uint64)
    return np.where(b & 0x80000000, (~b) & 0xFFFFFFFF, b | 0x80000000).astype(np.uint64)
def entry(l, ids):
    return np.where(l == l, (order_key(l) << 32) | (0xFFFFFFFF - ids.astype(np.uint64)), 0)
def argmax_id(e):
    m = e.max() if len(e) else 0
    return 0 if m == 0 else int(0xFFFFFFFF - (int(m) & 0xFFFFFFFF))
TINY = f32(9.094947e-13)
def quantize(W):
    V, D = W.shape
    m = np.zeros((V, 32), np.float32)
    for k in range(0, D, 256):
        for i in range(8):
            m = np.fmax(m, np.abs(W[:, k + np.arange(32) * 8 + i]))
    m = warp_max(m)
    s = (m / f32(127)).astype(np.float32)
    inv = np.where(m > 0, f32(127) / np.where(m > 0, m, 1), 0).astype(np.float32)
    q = np.zeros((V, D), np.int8)
    dd = np.zeros((V, 32), np.float32); ww = np.zeros((V, 32), np.float32)
    for k in range(0, D, 256):
        for i in range(8):
            cols = k + np.arange(32) * 8 + i
            a = W[:, cols]
            with np.errstate(invalid='ignore'):
                qi = np.clip(np.rint((a * inv[:, None]).astype(np.float32)), -127, 127)
            qi = np.where(np.isnan(qi), -127, qi).astype(np.float32)  # fmaxf(NaN, -127) = -127
            with np.errstate(invalid='ignore'):  # inf weights: NaN, as on the GPU
                d = (a - (s[:, None] * qi).astype(np.float32)).astype(np.float32)
            dd = (dd + d * d).astype(np.float32); ww = (ww + a * a).astype(np.float32)
            q[:, cols] = qi.astype(np.int8)
    dd = warp_sum(dd); ww = warp_sum(ww)
    err = ((np.sqrt(dd) + f32(2 * D * 5.9604645e-8 + 1e-6) * np.sqrt(ww)) * f32(1.001)).astype(np.float32)
    err = np.where((m > 0) & (m < TINY), np.inf, err).astype(np.float32)
    return q, s, err
def screen(q, s, err, x, nv):
    V, D = q.shape
    # thread t stages x[8t, 8t + 8): its sums, a warp's by shuffles, then the 8 warps'
    xt = x.reshape(D // 8, 8)
    xx = np.zeros(D // 8, np.float32); xm = np.zeros(D // 8, np.float32)
    for i in range(8):
        xx = (xx + xt[:, i] * xt[:, i]).astype(np.float32); xm = np.fmax(xm, np.abs(xt[:, i]))
    xx = warp_sum(xx.reshape(-1, 32)); xm = warp_max(xm.reshape(-1, 32))
    tot = np.float32(0)
    for w in range(len(xx)):
        tot = np.float32(tot + xx[w])
    xm = xm.max()
    xn = np.float32(np.inf) if (xm > 0 and xm < TINY) else np.sqrt(tot)
    acc = np.zeros((V, 32), np.float32)
    for k in range(D // 512):  # lane chunk: elements lane*16 + 512k .. +16
        for i in range(16):
            cols = np.arange(32) * 16 + 512 * k + i
            acc = (acc + q[:, cols].astype(np.float32) * x[cols]).astype(np.float32)
    lq = (warp_sum(acc) * s).astype(np.float32)
    with np.errstate(invalid='ignore', over='ignore'):
        b = (err * xn).astype(np.float32)
        finite = (np.abs(lq) < np.inf) & (b < np.inf)
        hi = np.where(finite, (lq + b).astype(np.float32), np.inf)[:nv]
        lo = (lq - b).astype(np.float32)
    keys = order_key(lo)[:nv][finite[:nv] & ~np.isnan(lo[:nv])]
    return hi, (int(keys.max()) if len(keys) else 0)
def pick(hi, lk, W, x):
    t = -np.inf  # no finite bound anywhere: every row
    if lk:  # order_key's inverse
        b = (lk & 0x7FFFFFFF) if lk & 0x80000000 else (~lk) & 0xFFFFFFFF
        t = np.array([b], np.uint32).view(np.float32)[0]
    cand = np.nonzero(hi >= t)[0]
    l = full_logits(W[cand], x) if len(cand) else np.zeros(0, np.float32)
    return argmax_id(entry(l, cand)), len(cand)
rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
V, D = 6011, 2048  # not a multiple of the screen's 16 rows or the pick's 1024
fails = 0
for trial in range(12):
    W = bf16(rng.standard_normal((V, D)) * 0.02)
    x = bf16(rng.standard_normal(D) * [1, 1e-3, 1e3][trial % 3])
    if trial % 4 == 1:  # exact tie
        full = full_logits(W, x); top = int(np.argmax(full))
        W[(top + 1234) % V] = W[top]; W[(top + 4321) % V] = W[top]
    if trial % 4 == 2:
        W[17, 5] = np.nan; W[99, 7] = np.inf if x[7] > 0 else -np.inf
    if trial % 4 == 3:
        W[200:210] = 0.0
    nv = V if trial % 2 == 0 else V - 1000
    full = full_logits(W, x)
    want = argmax_id(entry(full[:nv], np.arange(nv)))
    q, s, err = quantize(W)
    hi, lk = screen(q, s, err, x, nv)
    got, nc = pick(hi, lk, W, x)
    ok = got == want
    fails += not ok
    print(f"trial {trial}: want {want} got {got} candidates {nc} {'ok' if ok else 'FAIL'}")
# planted error: a wrong chunk mapping in the screen must be caught
def screen_bad(q, s, err, x, nv):
    return screen(q[:, np.r_[8:D, 0:8]], s, err, x, nv)
W = bf16(rng.standard_normal((V, D)) * 0.02); x = bf16(rng.standard_normal(D))
q, s, err = quantize(W); hi, lk = screen_bad(q, s, err, x, V)
got, nc = pick(hi, lk, W, x)
print("planted mapping error:", "caught" if got != argmax_id(entry(full_logits(W, x), np.arange(V))) or nc > V // 10 else "NOT caught", nc)
print("FAILS", fails)
sys.exit(1 if fails else 0)
