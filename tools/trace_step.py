#!/usr/bin/env python3
"""Summarise one decode step's timeline (`lily bench --trace DIR`: the
kernels' trace build): per kernel, over its launches in the step, where its
share of the step goes.

For launch i after launch i-1 (times in us, from the CSV):
- span: last_exit[i] - last_exit[i-1], its share of the critical path
  (the spans add up to the step);
- release: first_wait[i] - last_exit[i-1], from the producer's last block
  leaving to this kernel's first block passing its PDL wait (completion,
  memory flush, the wait's own latency);
- after: last_exit[i] - first_wait[i], from the first release to the last
  block leaving (its own latency chain and the bytes it streams after the
  wait);
- early: first_wait[i] - first_start[i], how long its first blocks were
  resident before their inputs were ready (the prologue PDL overlaps).
A kernel whose blocks never wait counts from its first start instead.
Then one attention layer and one GDN layer launch by launch (first and last
block start, first release, first and last exit).
With a phase mark (`lily bench --trace DIR --trace-mark n`: the kernel's
TRACE_MARK(n), e.g. gdn.cu 1-6, moe.cu 11 and 21-22), per marked
kernel the first and last block's pass of it, from the launch's first release
(mean over its launches): comparing runs with successive marks splits the
time after the wait into phases.

usage: trace_step.py trace-4096.csv [more.csv ...]
"""
import csv
import sys
from collections import OrderedDict


def load(path):
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            for k in ("first_start", "last_start", "first_wait", "last_wait", "first_exit", "last_exit",
                      "first_mark", "last_mark"):
                r[k] = float(r[k]) if r.get(k) not in (None, "") else None
            r["blocks"] = int(r["blocks"])
            rows.append(r)
    return rows


def summarise(rows):
    per = OrderedDict()
    prev_exit = 0.0
    for r in rows:
        rel = r["first_wait"] if r["first_wait"] is not None else r["first_start"]
        # by kernel and grid size: the GDN and attention layers' projections differ
        s = per.setdefault((r["kernel"], r["blocks"]), {"n": 0, "blocks": r["blocks"], "group": r.get("group", "?"), "span": 0.0, "release": 0.0,
                                         "after": 0.0, "early": 0.0})
        s["n"] += 1
        s["span"] += r["last_exit"] - prev_exit
        s["release"] += rel - prev_exit
        s["after"] += r["last_exit"] - rel
        s["early"] += rel - r["first_start"]
        prev_exit = r["last_exit"]
    return per, prev_exit


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        rows = load(path)
        per, step = summarise(rows)
        print(f"{path}: {len(rows)} launches, step {step:.1f} us (first start to last exit)")
        print(f"{'kernel':<32} {'launches':>8} {'blocks':>7} {'span us':>9} {'share':>6} "
              f"{'release/launch':>14} {'after/launch':>12} {'early/launch':>12}")
        for k, s in sorted(per.items(), key=lambda kv: -kv[1]["span"]):
            n = s["n"]
            print(f"{k[0]:<32} {n:>8} {s['blocks']:>7} {s['span']:>9.1f} {100 * s['span'] / step:>5.1f}% "
                  f"{s['release'] / n:>14.2f} {s['after'] / n:>12.2f} {s['early'] / n:>12.2f}")
        groups = OrderedDict()
        for k, sp in per.items():
            g = sp.get("group", "?")
            groups[g] = groups.get(g, 0.0) + sp["span"]
        print("by profile group (the kernel table's): " + ", ".join(
            f"{g} {v:.1f} us ({100 * v / step:.1f}%)" for g, v in sorted(groups.items(), key=lambda kv: -kv[1])))
        for name, core in (("attention", "attention_decode_partial_kernel"), ("GDN", "gdn_decode_kernel")):
            window(rows, name, core)
        marks(rows)


def marks(rows):
    """The phase mark's first and last pass per kernel, from the launch's
    first release, and its first and last exit likewise (means)."""
    per = OrderedDict()
    for r in rows:
        if r["first_mark"] is None:
            continue
        rel = r["first_wait"] if r["first_wait"] is not None else r["first_start"]
        s = per.setdefault((r["kernel"], r["blocks"]), [0, 0.0, 0.0, 0.0, 0.0])
        s[0] += 1
        for i, k in enumerate(("first_mark", "last_mark", "first_exit", "last_exit")):
            s[i + 1] += r[k] - rel
    if not per:
        return
    print("phase mark (us from the launch's first release; mean over launches):")
    print(f"{'kernel':<32} {'blocks':>7} {'launches':>8} {'first mark':>10} {'last mark':>9} "
          f"{'first exit':>10} {'last exit':>9}")
    for (k, b), s in per.items():
        n = s[0]
        print(f"{k:<32} {b:>7} {n:>8} {s[1] / n:>10.2f} {s[2] / n:>9.2f} {s[3] / n:>10.2f} {s[4] / n:>9.2f}")


def window(rows, name, core):
    """One whole layer of the given kind (its second occurrence, so not the
    first layer), launch by launch, from its input projection to its down
    product: times relative to the input projection's first start."""
    cores = [i for i, r in enumerate(rows) if r["kernel"] == core]
    if len(cores) < 2:
        return
    c = cores[1]
    a = max((i for i in range(c) if rows[i]["kernel"].startswith("gemv3")), default=None)
    if a is None:
        return
    b = next((i for i in range(c, len(rows)) if rows[i]["kernel"] == "down"), len(rows) - 1)
    t0 = rows[a]["first_start"]
    print(f"one {name} layer (launches {a}..{b}; us from its input projection's first start):")
    print(f"{'kernel':<32} {'blocks':>7} {'first start':>11} {'last start':>10} {'release':>8} "
          f"{'first exit':>10} {'last exit':>9}")
    for r in rows[a:b + 1]:
        f = [r[k] - t0 if r[k] is not None else float("nan")
             for k in ("first_start", "last_start", "first_wait", "first_exit", "last_exit")]
        print(f"{r['kernel']:<16} {r['blocks']:>7} {f[0]:>11.2f} {f[1]:>10.2f} {f[2]:>8.2f} {f[3]:>10.2f} {f[4]:>9.2f}")


if __name__ == "__main__":
    main()
