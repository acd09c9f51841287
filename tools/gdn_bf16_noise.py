"""How far the chunked GDN prefill on the tensor cores (kernels/gdn_chunked.cu)
may drift from an exact recurrence: the chunked form emulated in numpy with
bf16 rounding (to nearest even) at exactly the points the kernels round, f32
sums, against an f64 recurrent reference (lily-cpu GdnCore::head_recurrent),
on the input distribution of crates/lily-cuda/tests/gdn_gpu.rs. Its figures
set that test's tolerances (TOL_O, TOL_S). A few seconds on 2 cores.

usage: python3 tools/gdn_bf16_noise.py [seeds...]
"""
import os, sys, time
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("OMP_NUM_THREADS", "2")
import numpy as np

DK = DV = 128
CH = 64
HK, HV = 2, 4          # 4 v heads on 2 k heads (j -> j // 2), as Hv/Hk = 2 at release
C = 2 * HK * DK + HV * DV
f32 = np.float32


def bf16(x):
    """float32 -> bf16 (round to nearest even) -> float32, by the bits."""
    x = np.ascontiguousarray(x, dtype=f32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(f32).reshape(x.shape)


def ident(x):
    return np.asarray(x, dtype=f32)


# ---------------------------------------------------------------- inputs
def uni(rng, n, mean, std):
    """uniform with this mean/std, bf16-rounded, zero nudged (as random_nonzero)."""
    h = std * np.sqrt(3.0)
    x = bf16(rng.uniform(mean - h, mean + h, n).astype(f32))
    x[x == 0] = f32(1e-3)
    return x


def inputs(t, seed, dlo=0.5, dhi=0.999):
    rng = np.random.default_rng(seed)
    conv = uni(rng, t * C, 0.0, 1.0).reshape(t, C)
    a_log = uni(rng, HV, 0.0, 0.3)
    dt_bias = uni(rng, HV, 0.0, 0.6)
    beta = uni(rng, t * HV, 0.5, 0.8 / np.sqrt(12)).reshape(t, HV)
    decay = uni(rng, t * HV, (dlo + dhi) / 2, (dhi - dlo) / np.sqrt(12)).reshape(t, HV)
    bt = np.clip(beta, 0.1, 0.9).astype(np.float64)
    b = np.log(bt / (1 - bt)).astype(f32)
    d = np.clip(decay, dlo, dhi).astype(np.float64)
    sp = -np.log(d) / np.exp(a_log.astype(np.float64))
    a = (np.log(np.expm1(sp)) - dt_bias.astype(np.float64)).astype(f32)
    s0 = uni(rng, HV * DK * DV, 0.0, 0.5).reshape(HV, DK, DV)
    return dict(t=t, conv=conv, b=b, a=a, a_log=a_log, dt_bias=dt_bias, s0=s0)


def split(x, dtype):
    """q, k [T, HV, DK] (k head j // (HV/HK) per v head), v [T, HV, DV], raw."""
    conv = x["conv"].astype(dtype)
    t = x["t"]
    q = conv[:, :HK * DK].reshape(t, HK, DK)
    k = conv[:, HK * DK:2 * HK * DK].reshape(t, HK, DK)
    v = conv[:, 2 * HK * DK:].reshape(t, HV, DV)
    kh = np.arange(HV) // (HV // HK)
    return q[:, kh], k[:, kh], v


# ---------------------------------------------------------------- exact reference (f64, recurrent)
def reference(x):
    q, k, v = split(x, np.float64)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(DK)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-x["b"].astype(np.float64)))
    g = -np.exp(x["a_log"].astype(np.float64)) * np.log1p(np.exp(x["a"].astype(np.float64) + x["dt_bias"]))
    S = x["s0"].astype(np.float64).copy()
    o = np.empty((x["t"], HV, DV))
    for ti in range(x["t"]):
        S *= np.exp(g[ti])[:, None, None]
        u = np.einsum("hrc,hr->hc", S, k[ti])
        u = beta[ti][:, None] * (v[ti] - u)
        S += k[ti][:, :, None] * u[:, None, :]
        o[ti] = np.einsum("hrc,hr->hc", S, q[ti])
    return o, S


# ---------------------------------------------------------------- chunked emulation (f32, rounding hook)
def chunked(x, rnd=bf16, bug=None, only=None):
    """The two kernels of gdn_chunked.cu, per v head (batched over heads).
    rnd: the bf16 rounding (bf16) or none (ident). bug: a deliberate mistake."""
    R_ = lambda a, name=None: rnd(a) if (only is None or name in only) else ident(a)
    t = x["t"]
    q, k, v = split(x, f32)                        # raw conv rows, f32
    if bug == "head_map":                          # kh = j % Hk instead of j / (Hv/Hk)
        qq, kk_, _ = split(x, f32)
        alt = np.arange(HV) % HK * (HV // HK)      # v head whose k head is j % Hk
        q, k = qq[:, alt], kk_[:, alt]
    bt = (f32(1) / (f32(1) + np.exp(-x["b"]))).astype(f32)          # [T, HV]
    sp = np.where(x["a"] + x["dt_bias"] > 20, x["a"] + x["dt_bias"],
                  np.log1p(np.exp(x["a"] + x["dt_bias"]))).astype(f32)
    g = (-np.exp(x["a_log"]) * sp).astype(f32)
    if bug == "no_beta":
        bt = np.ones_like(bt)
    S = x["s0"].astype(f32).copy()                 # [HV, DK, DV], f32 across chunks
    o = np.empty((t, HV, DV), f32)
    for c0 in range(0, t, CH):
        n = min(CH, t - c0)
        qc = q[c0:c0 + n].transpose(1, 0, 2)       # [HV, n, DK]
        kc = k[c0:c0 + n].transpose(1, 0, 2)
        vc = v[c0:c0 + n].transpose(1, 0, 2)
        beta = bt[c0:c0 + n].T                     # [HV, n]
        gg = g[c0:c0 + n].T
        # ---- prep kernel
        qinv = (f32(1) / np.sqrt((qc * qc).sum(-1, dtype=f32) + f32(1e-6)) / np.sqrt(f32(DK))).astype(f32)
        kinv = (f32(1) / np.sqrt((kc * kc).sum(-1, dtype=f32) + f32(1e-6))).astype(f32)
        Qn = R_(qc * qinv[..., None], "QnKn")
        Kn = R_(kc * kinv[..., None], "QnKn")
        gam = np.cumsum(gg, axis=1, dtype=f32)     # sequential f32
        if bug == "gam_exclusive":                 # cumsum shifted by one token
            gam = np.concatenate([np.zeros_like(gam[:, :1]), gam[:, :-1]], axis=1)
        glast = gam[:, n - 1]
        eg = np.exp(gam)
        ed = np.exp(glast[:, None] - gam)
        kk = np.matmul(Kn, Kn.transpose(0, 2, 1))  # f32 accumulation
        qk = np.matmul(Qn, Kn.transpose(0, 2, 1))
        i_ = np.arange(n)
        lower_eq = i_[:, None] >= i_[None, :]
        strict = i_[:, None] > i_[None, :]
        e = np.where(lower_eq, np.exp(np.minimum(gam[:, :, None] - gam[:, None, :], 0)), 0).astype(f32)
        A = np.where(strict, beta[:, :, None] * kk * e, 0).astype(f32)
        if bug == "A_no_beta":
            A = np.where(strict, kk * e, 0).astype(f32)
        P = R_(np.where(strict if bug == "P_no_diag" else lower_eq, qk * e, 0), "P")
        # T = (I + A)^-1 in f32, forward substitution (row i: T_i = e_i - sum_{l<i} A_il T_l)
        T = np.zeros((HV, n, n), f32)
        for r in range(n):
            row = -np.matmul(A[:, r:r + 1, :r], T[:, :r, :])[:, 0] if r else np.zeros((HV, n), f32)
            row[:, r] = 1
            T[:, r] = row
        Tb = R_(T, "T")
        fk = (beta * kinv * eg).astype(f32)
        Rhs = R_(np.concatenate([beta[..., None] * vc, kc * fk[..., None]], axis=2), "R")
        UW = R_(np.matmul(Tb, Rhs), "UW")
        U, W = UW[..., :DV], UW[..., DV:]
        Qg = R_(qc * (qinv * eg)[..., None], "QgKd")
        if bug == "kd_gam_i":                      # exp(gam_i) in place of exp(gam_{n-1} - gam_i)
            Kd = R_(kc * (kinv * eg)[..., None], "QgKd")
        else:
            Kd = R_(kc * (kinv * ed)[..., None], "QgKd")
        # ---- scan kernel
        el = np.exp(glast)
        if bug == "decay_gam_nm2":                 # S decayed by exp(gam_{n-2}) (off by one)
            el = np.exp(gam[:, max(n - 2, 0)])
        if bug == "decay_gam0":                    # S decayed by exp(gam_0) (gam_i, i = 0)
            el = np.exp(gam[:, 0])
        if bug == "no_S_decay":                    # S carried undecayed
            el = np.ones_like(glast)
        Sb = R_(S, "S")
        ws = np.matmul(W, Sb)
        oa = np.matmul(Qg, Sb)
        vp = R_(U - ws, "vp")
        oa = oa + np.matmul(P, vp)
        o[c0:c0 + n] = oa.transpose(1, 0, 2)
        S = (S * el[:, None, None]).astype(f32) + np.matmul(Kd.transpose(0, 2, 1), vp)
    return o, S


def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


if __name__ == "__main__":
    seeds = [int(s) for s in sys.argv[1:]] or [1, 2, 3]
    TS = [1, 63, 64, 65, 300, 1000, 2100]
    t0 = time.time()
    bugs = ["kd_gam_i", "decay_gam0", "decay_gam_nm2", "no_S_decay", "no_beta", "A_no_beta",
            "P_no_diag", "gam_exclusive", "head_map"]
    for (dlo, dhi) in [(0.5, 0.999), (0.9, 0.999), (0.99, 0.9999)]:
        print(f"\n=== decay exp(g) uniform in {dlo}..{dhi}; HK={HK} HV={HV} DK={DK} DV={DV} seeds={seeds}")
        print(f"{'T':>5} {'seed':>4} | {'bf16 o':>9} {'bf16 S':>9} | {'f32 o':>9} {'f32 S':>9} | {'max|o|':>7}")
        worst = [0.0, 0.0, 0.0, 0.0]
        refs = {}
        for T in TS:
            for sd in seeds:
                x = inputs(T, 1000 * sd + T, dlo, dhi)
                ro, rS = reference(x)
                refs[(T, sd)] = (x, ro, rS)
                bo, bS = chunked(x, bf16)
                fo, fS = chunked(x, ident)
                e = [rel(bo, ro), rel(bS, rS), rel(fo, ro), rel(fS, rS)]
                worst = [max(a, b) for a, b in zip(worst, e)]
                print(f"{T:>5} {sd:>4} | {e[0]:9.2e} {e[1]:9.2e} | {e[2]:9.2e} {e[3]:9.2e} | {np.abs(ro).max():7.3f}",
                      flush=True)
        print(f"worst bf16: o {worst[0]:.2e}  S {worst[1]:.2e}  (3x: o {3*worst[0]:.1e}  S {3*worst[1]:.1e});"
              f"  worst f32: o {worst[2]:.1e} S {worst[3]:.1e}   ({time.time() - t0:.0f}s)")
        print(f"mistakes (bf16 emulation, seed {seeds[0]}):")
        TB = (1, 65, 1000)
        print(f"{'bug':>14} " + " ".join(f"{'T=%d o' % T:>10} {'S':>8}" for T in TB))
        for bug in bugs:
            cells = []
            for T in TB:
                x, ro, rS = refs[(T, seeds[0])]
                bo, bS = chunked(x, bf16, bug)
                cells.append(f"{rel(bo, ro):10.2e} {rel(bS, rS):8.2e}")
            print(f"{bug:>14} " + " ".join(cells), flush=True)
        cells = []
        for T in TB:
            x, ro, rS = refs[(T, seeds[0])]
            y = dict(x)
            y["s0"] = uni(np.random.default_rng(7), HV * DK * DV, 0, 0.5).reshape(HV, DK, DV)
            bo, bS = chunked(y, bf16)
            cells.append(f"{rel(bo, ro):10.2e} {rel(bS, rS):8.2e}")
        print(f"{'other_s0':>14} " + " ".join(cells))
    print(f"({time.time() - t0:.0f}s)")
