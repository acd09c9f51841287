#!/usr/bin/env python3
"""The roofline tables, in Markdown, from a `lily bench --json --profile`
output (BENCHMARKS.md's tables are made with it).

Prefill: per kernel group of a prompt's last chunk (events between groups,
summed over the layers), its time, the FLOPs it computes, the rate that
gives and its share of the chunk.

Decode: per kernel group
of one step, its time inside the captured step ("graph us": the whole step's
replay time minus the step's without the group), the bytes it must move, the
bandwidth that gives, its share of the step and its floor at the measured
copy bandwidth; "eager us" is the same group timed by events between groups
launched kernel by kernel.

usage: roofline.py bench.json [more.json ...]
"""
import json
import sys


def table(path):
    r = json.load(open(path))
    bw = r["copy_bandwidth_gb_s"] * 1e9
    out = []
    for row in r["prefill"]:
        prof = row.get("profile")
        if not prof:
            continue
        total = sum(p["us"] for p in prof)
        flops = sum(p["flops"] for p in prof)
        c = row["profile_chunk"]
        out.append(f"Prefill of {row['prompt_len']:,} tokens ({row['prefill_tok_s']:,.0f} tok/s in that run), its last "
                   f"chunk: {c['tokens']:,} tokens after {c['pos']:,} ({r['device']}):\n")
        out.append("| group | count | us | GFLOP | TFLOP/s | share |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for p in prof + [{"group": "chunk", "count": "", "us": total, "flops": flops}]:
            rate = p["flops"] / (p["us"] * 1e-6) / 1e12 if p["us"] > 0 else 0.0
            out.append(f"| {p['group']} | {p['count']} | {p['us']:,.1f} | {p['flops'] / 1e9:,.1f} | "
                       f"{rate:,.1f} | {100 * p['us'] / total:.1f}% |")
        out.append("")
    for row in r["decode"]:
        prof = row.get("profile")
        if not prof:
            continue
        whole = row["graph_step_us"]
        total_bytes = sum(p["bytes"] for p in prof)
        out.append(f"One decode step at context {row['context']} ({row['decode_tok_s']:.1f} tok/s in that run; "
                   f"copy bandwidth {bw / 1e9:,.0f} GB/s; {r['device']}):\n")
        out.append("| group | count | eager us | graph us | MB moved | GB/s | share | floor us |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        accounted = 0.0
        for p in prof:
            g = p["graph_us"] if p["graph_us"] is not None else float("nan")
            accounted += g
            out.append(f"| {p['group']} | {p['count']} | {p['us']:.1f} | {g:.1f} | {p['bytes'] / 1e6:,.2f} | "
                       f"{p['bytes'] / (g * 1e-6) / 1e9:,.0f} | {100 * g / whole:.1f}% | {p['bytes'] / bw * 1e6:.1f} |")
        eager = sum(p["us"] for p in prof)
        out.append(f"| step | | {eager:.1f} | {whole:.1f} | {total_bytes / 1e6:,.2f} | "
                   f"{total_bytes / (whole * 1e-6) / 1e9:,.0f} | {100 * accounted / whole:.1f}% accounted | "
                   f"{total_bytes / bw * 1e6:.1f} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        print(table(path))
