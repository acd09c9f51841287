"""Lane-by-lane emulation of the decode attention kernels
(crates/lily-cuda/kernels/attention.cu: attention_decode_partial_kernel and
attention_decode_merge_kernel) against an f64 reference, for checking an
index change (MMA fragment layouts, byte permutes, the warps' shared-memory
tiles, the split and batch bounds) on a machine without a GPU. It mirrors the
kernels by hand, so it must be kept in step with them; the GPU tests
(crates/lily-cuda/tests/attention_gpu.rs) remain the authority.

The emulated MMA computes exactly, so only the bf16 hi/lo splits' rounding
shows in the error (relative L2 ~1e-6); a wrong mapping shows as ~1. Loads
assert alignment and that no row at or past n is read; the output tile
asserts one write a cell. MINK=K in the environment emulates
LILY_KERNEL_DEFINES=LILY_ATTD_MIN_KEYS=K (branch next/attn-splits).

Usage (pure Python, slow: seconds to minutes a case):
  python3 tools/attention_emu.py "[(Hq, Hkv, Dh, n, splits), ...]"
  python3 tools/attention_emu.py "[(16,2,256,37,5),(4,2,64,19,2),(32,2,160,33,2)]"
"""
import ast, os, struct, math, random, sys
INF = float('inf')
def f32(x): return struct.unpack('f', struct.pack('f', x))[0]
def f2bits(x): return struct.unpack('I', struct.pack('f', x))[0]
def bits2f(u): return struct.unpack('f', struct.pack('I', u & 0xffffffff))[0]
def bf_rn(x):  # f32 -> bf16 bits RNE
    u = f2bits(f32(x))
    if (u & 0x7fffffff) > 0x7f800000: return (u >> 16) | 0x40
    return ((u + 0x7fff + ((u >> 16) & 1)) >> 16) & 0xffff
def bf2f(b): return bits2f(b << 16)
def cvt_bf16x2(a, b): return (bf_rn(a) << 16) | bf_rn(b)  # a upper, b lower
def split_bf16x2(x, y):
    hi = cvt_bf16x2(y, x)
    rx = f32(x - bits2f((hi << 16) & 0xffffffff)); ry = f32(y - bits2f(hi & 0xffff0000))
    lo = cvt_bf16x2(ry, rx)
    return hi, lo
def byte_perm(x, y, s):
    src = [(x >> (8*i)) & 0xff for i in range(4)] + [(y >> (8*i)) & 0xff for i in range(4)]
    r = 0
    for n in range(4): r |= src[(s >> (4*n)) & 7] << (8*n)
    return r
def lo16(w): return bf2f(w & 0xffff)
def hi16(w): return bf2f((w >> 16) & 0xffff)

def mma(C, A, B):
    # C: 32 lists of 4 floats (in/out); A: 32 tuples of 4 words; B: 32 tuples of 2 words
    Am = [[None]*16 for _ in range(16)]; Bm = [[None]*8 for _ in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a0, a1, a2, a3 = A[lane]; b0, b1 = B[lane]
        Am[g][2*t], Am[g][2*t+1] = lo16(a0), hi16(a0)
        Am[g+8][2*t], Am[g+8][2*t+1] = lo16(a1), hi16(a1)
        Am[g][2*t+8], Am[g][2*t+9] = lo16(a2), hi16(a2)
        Am[g+8][2*t+8], Am[g+8][2*t+9] = lo16(a3), hi16(a3)
        Bm[2*t][g], Bm[2*t+1][g] = lo16(b0), hi16(b0)
        Bm[2*t+8][g], Bm[2*t+9][g] = lo16(b1), hi16(b1)
    D = [[sum(Am[r][k]*Bm[k][c] for k in range(16)) for c in range(8)] for r in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        C[lane][0] += D[g][2*t]; C[lane][1] += D[g][2*t+1]
        C[lane][2] += D[g+8][2*t]; C[lane][3] += D[g+8][2*t+1]

class Mem:
    def __init__(s, bits, rowlen, nvalid): s.bits, s.rowlen, s.nvalid = bits, rowlen, nvalid
    def v4(s, p):
        assert p % 8 == 0, "misaligned"
        assert 0 <= p and p + 8 <= len(s.bits)
        assert p // s.rowlen < s.nvalid, "read past n: row %d" % (p // s.rowlen)
        return tuple(s.bits[p+2*i] | (s.bits[p+2*i+1] << 16) for i in range(4))

ATTD_WARPS, ATTD_HEADS, ATTD_BATCH, STRIDE = 4, 8, 16, 292
MINK = int(os.environ.get("MINK", "0"))
LOG2E = f32(1.4426950408889634)

def partial_block(bx, s, q, K, V, n, part, Hq, Hkv, Dh, splits, scale):
    G = Hq // Hkv; cpg = (G + 7) // 8
    kh, c = bx // cpg, bx % cpg
    h0, nh = kh*G + c*8, min(8, G - c*8)
    live = min(splits, max(1, (n + MINK - 1)//MINK)) if MINK > 0 else splits
    if s >= live: return
    chunk = (n + live - 1) // live
    k0 = min(s*chunk, n); k1 = min(k0 + chunk, n)
    per = ((k1 - k0 + 3)//4 + 15)//16*16
    rs = Hkv*Dh
    # stage q fragments
    sm_q = [[[None]*32 for _ in range(2)] for _ in range(8)]
    qs = f32(scale * LOG2E)
    for it in range(256):
        u, gg, tt = it >> 5, (it & 31) >> 2, it & 3
        x = [0.0]*4; y = [0.0]*4
        if gg < nh and 32*u < Dh:
            base = (h0+gg)*Dh + 32*u + 8*tt
            assert base % 4 == 0
            x = q[base:base+4]; y = q[base+4:base+8]
        f0 = split_bf16x2(f32(x[0]*qs), f32(x[1]*qs)) + split_bf16x2(f32(x[2]*qs), f32(x[3]*qs))
        f1 = split_bf16x2(f32(y[0]*qs), f32(y[1]*qs)) + split_bf16x2(f32(y[2]*qs), f32(y[3]*qs))
        sm_q[u][0][it & 31] = f0; sm_q[u][1][it & 31] = f1
    sm_m = [[None]*8 for _ in range(4)]; sm_l = [[None]*8 for _ in range(4)]
    sm_frag = [[[None]*32 for _ in range(64)] for _ in range(4)]
    for w in range(4):
        a = min(k0 + w*per, k1); b = min(a + per, k1)
        kb = kh*Dh  # + 8t per lane
        def load_k(j0):
            kraw = [[[None]*8 for _ in range(2)] for _ in range(32)]
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for T in range(2):
                    kr = kb + 8*t + min(j0 + 8*T + g, b - 1)*rs
                    for u in range(8):
                        if 32*u < Dh: kraw[lane][T][u] = K.v4(kr + 32*u)
            return kraw
        def load_v(hv, j0):
            vraw = []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                vb = kh*Dh
                voff = [64*v + 8*g if 64*v + 8*g < Dh else 0 for v in range(4)]
                r = []
                for k in range(4):
                    key = j0 + 2*t + (k & 1) + 8*(k >> 1)
                    vr = vb + min(key, b - 1)*rs
                    r.append((V.v4(vr + voff[hv]), V.v4(vr + voff[hv + 2])))
                vraw.append(r)
            return vraw
        if a < b:
            kraw = load_k(a); v0 = load_v(0, a); v1 = load_v(1, a)
        acc = [[[0.0]*4 for _ in range(16)] for _ in range(32)]  # [lane][i][4]
        m = [-INF]*32; l = [0.0]*32
        j0 = a
        while j0 < b:
            sq = [[[[0.0]*4 for _ in range(32)] for _ in range(2)] for _ in range(2)]  # [T][par][lane][4]
            for u in range(8):
                if 32*u < Dh:
                    for T in range(2):
                        mma(sq[T][0], [sm_q[u][0][ln] for ln in range(32)], [(kraw[ln][T][u][0], kraw[ln][T][u][1]) for ln in range(32)])
                        mma(sq[T][1], [sm_q[u][1][ln] for ln in range(32)], [(kraw[ln][T][u][2], kraw[ln][T][u][3]) for ln in range(32)])
            sc = [[None]*4 for _ in range(32)]
            for lane in range(32):
                t = lane & 3
                for T in range(2):
                    key = j0 + 8*T + 2*t
                    s0 = (sq[T][0][lane][0] + sq[T][0][lane][2]) + (sq[T][1][lane][0] + sq[T][1][lane][2])
                    s1 = (sq[T][0][lane][1] + sq[T][0][lane][3]) + (sq[T][1][lane][1] + sq[T][1][lane][3])
                    sc[lane][2*T] = s0 if key < b else -INF
                    sc[lane][2*T+1] = s1 if key + 1 < b else -INF
            if j0 + 16 < b: kraw = load_k(j0 + 16)
            bm = [max(sc[ln]) for ln in range(32)]
            bm = [max(bm[ln], bm[ln ^ 1]) for ln in range(32)]
            bm = [max(bm[ln], bm[ln ^ 2]) for ln in range(32)]
            corr = [None]*32; p = [None]*32
            for ln in range(32):
                mn = max(m[ln], bm[ln]); assert math.isfinite(mn)
                corr[ln] = 2.0 ** (m[ln] - mn)
                p[ln] = [2.0 ** (x - mn) if x != -INF else 0.0 for x in sc[ln]]
                l[ln] = l[ln]*corr[ln] + ((p[ln][0] + p[ln][1]) + (p[ln][2] + p[ln][3]))
                m[ln] = mn
            for ln in range(32):
                t = ln & 3
                c0, c1 = corr[8*t], corr[8*t + 4]
                for i in range(16):
                    acc[ln][i][0] *= c0; acc[ln][i][1] *= c1; acc[ln][i][2] *= c0; acc[ln][i][3] *= c1
            ph0, pl0, ph1, pl1 = [], [], [], []
            for ln in range(32):
                h_, l_ = split_bf16x2(f32(p[ln][0]), f32(p[ln][1])); ph0.append(h_); pl0.append(l_)
                h_, l_ = split_bf16x2(f32(p[ln][2]), f32(p[ln][3])); ph1.append(h_); pl1.append(l_)
            for vraw, hv in ((v0, 0), (v1, 1)):
                for ii in range(8):
                    i, e = 8*hv + ii, ii >> 1
                    sel = 0x7632 if ii & 1 else 0x5410
                    A = []
                    for ln in range(32):
                        vr = vraw[ln]
                        A.append((byte_perm(vr[0][0][e], vr[1][0][e], sel), byte_perm(vr[0][1][e], vr[1][1][e], sel),
                                  byte_perm(vr[2][0][e], vr[3][0][e], sel), byte_perm(vr[2][1][e], vr[3][1][e], sel)))
                    C = [acc[ln][i] for ln in range(32)]
                    mma(C, A, [(ph0[ln], ph1[ln]) for ln in range(32)])
                    mma(C, A, [(pl0[ln], pl1[ln]) for ln in range(32)])
            if j0 + 16 < b: v0 = load_v(0, j0 + 16); v1 = load_v(1, j0 + 16)
            j0 += 16
        l = [l[ln] + l[ln ^ 1] for ln in range(32)]
        l = [l[ln] + l[ln ^ 2] for ln in range(32)]
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            if t == 0: sm_m[w][g] = m[ln]; sm_l[w][g] = l[ln]
            for i in range(16):
                for k in range(4): sm_frag[w][4*i+k][ln] = acc[ln][i][k]
    pbase = Hq*splits*Dh
    sm_f = [[None]*8 for _ in range(4)]
    for h in range(8):
        M = max(sm_m[i][h] for i in range(4)); L = 0.0
        for i in range(4):
            f = 0.0 if sm_m[i][h] == -INF else 2.0 ** (sm_m[i][h] - M)
            sm_f[i][h] = f; L += sm_l[i][h]*f
        if h < nh:
            r = (h0 + h)*splits + s
            part[pbase + r] = M; part[pbase + Hq*splits + r] = L
    sm_out = [None]*(8*STRIDE)
    for w in range(4):
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            for j in range(16):
                r = 16*w + j; i, k = r >> 2, r & 3
                h, d = 2*t + (k & 1), 64*(i >> 3) + 128*(k >> 1) + 8*g + (i & 7)
                o = sum(sm_frag[x][r][ln]*sm_f[x][h] for x in range(4))
                idx = h*STRIDE + d + (d >> 3)
                assert idx < (h+1)*STRIDE
                assert sm_out[idx] is None, "double write"
                sm_out[idx] = o
    q4 = Dh >> 2
    for e in range(nh*q4):
        h = e // q4; d = (e - h*q4)*4
        src = h*STRIDE + d + (d >> 3)
        dst = ((h0 + h)*splits + s)*Dh + d
        assert dst % 4 == 0
        for z in range(4):
            assert sm_out[src + z] is not None
            part[dst + z] = sm_out[src + z]

def merge(part, qg, Hq, Dh, splits, gated, n=None):
    live = min(splits, max(1, (n + MINK - 1)//MINK)) if MINK > 0 else splits
    out = [None]*(Hq*Dh)
    pbase = Hq*splits*Dh
    for h in range(Hq):
        pm = pbase + h*splits; pl = pbase + Hq*splits + h*splits
        for y in range((Dh + 31)//32):
            sm_o = [[0]*32 for _ in range(8)]; sm_l = [0]*8
            Ms = []
            for w in range(8):
                mx = [-INF]*32
                for lane in range(32):
                    for i in range(9):
                        s = lane + 32*i
                        if s < live: mx[lane] = max(mx[lane], part[pm + s])
                    s = lane + 288
                    while s < live: mx[lane] = max(mx[lane], part[pm + s]); s += 32
                M = max(mx); Ms.append(M); assert math.isfinite(M)
                for lane in range(32):
                    d = y*32 + lane; act = d < Dh
                    pa = h*splits*Dh + (d if act else 0)
                    o = 0.0; lw = 0.0
                    s = w
                    while s < live:
                        mm = part[pm + s]
                        if mm != -INF:
                            f = 2.0 ** (mm - M); o += f*part[pa + s*Dh]; lw += f*part[pl + s]
                        s += 8
                    sm_o[w][lane] = o
                    if lane == 0: sm_l[w] = lw
            assert len(set(Ms)) == 1
            for lane in range(32):
                d = y*32 + lane
                if d < Dh:
                    v = sum(sm_o[i][lane] for i in range(8)); L = sum(sm_l)
                    v /= L
                    if gated: v *= 1/(1+math.exp(-qg[h*2*Dh + Dh + d]))
                    out[h*Dh + d] = v
    return out

def reference(q, K, V, n, Hq, Hkv, Dh, scale, qg, gated):
    G = Hq // Hkv; out = []
    for h in range(Hq):
        kh = h // G
        sc = [sum(q[h*Dh+d]*bf2f(K.bits[(j*Hkv+kh)*Dh+d]) for d in range(Dh))*scale for j in range(n)]
        M = max(sc); w = [math.exp(x - M) for x in sc]; T = sum(w)
        for d in range(Dh):
            o = sum(w[j]*bf2f(V.bits[(j*Hkv+kh)*Dh+d]) for j in range(n))/T
            if gated: o *= 1/(1+math.exp(-qg[h*2*Dh+Dh+d]))
            out.append(o)
    return out

def run(Hq, Hkv, Dh, n, splits, seed=1, gated=True, max_seq=None):
    rnd = random.Random(seed)
    max_seq = max_seq or n + 3
    rowlen = Hkv*Dh
    NANB = 0x7fc0
    K = [bf_rn(rnd.uniform(-1.7, 1.7)) if i < n*rowlen else NANB for i in range(max_seq*rowlen)]
    Vb = [bf_rn(rnd.uniform(-1.7, 1.7)) if i < n*rowlen else NANB for i in range(max_seq*rowlen)]
    q = [f32(rnd.uniform(-3.4, 3.4)) for _ in range(Hq*Dh)]
    qg = [f32(rnd.uniform(-2, 2)) for _ in range(Hq*2*Dh)]
    Km, Vm = Mem(K, rowlen, n), Mem(Vb, rowlen, n)
    part = [float('nan')]*(Hq*splits*(Dh+2))
    scale = f32(Dh ** -0.5)
    G = Hq // Hkv; cpg = (G + 7)//8
    for bx in range(Hkv*cpg):
        for s in range(splits):
            partial_block(bx, s, q, Km, Vm, n, part, Hq, Hkv, Dh, splits, scale)
    out = merge(part, qg, Hq, Dh, splits, gated, n)
    ref = reference(q, Km, Vm, n, Hq, Hkv, Dh, scale, qg, gated)
    num = sum((a-b)**2 for a, b in zip(out, ref)); den = sum(b*b for b in ref)
    worst = max(abs(a-b)/(abs(b)+1e-3) for a, b in zip(out, ref))
    print(f"Hq={Hq} Hkv={Hkv} Dh={Dh} n={n} splits={splits}: relL2={math.sqrt(num/den):.2e} worst={worst:.2e}", flush=True)
    return math.sqrt(num/den)

if __name__ == "__main__":
    cfgs = ast.literal_eval(sys.argv[1])
    for c in cfgs: run(*c)
