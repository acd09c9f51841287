#!/usr/bin/env python3
"""Nsight Compute's CSV (`ncu --csv --page details`) as one row per kernel and grid: launches,
total and mean time, grid and block, and the mean of its throughput and occupancy figures.

    python3 tools/ncu_table.py ncu-prefill.csv
"""
import csv
import sys
from collections import OrderedDict, defaultdict

# (column title, metric name as ncu writes it, how the launches combine)
COLUMNS = [
    ("SM %", "Compute (SM) Throughput", "mean"),
    ("mem %", "Memory Throughput", "mean"),
    ("DRAM GB", "dram__bytes_read.sum", "sum"),
    ("tensor %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "mean"),
    ("occupancy %", "Achieved Occupancy", "mean"),
    ("regs", "Registers Per Thread", "mean"),
]

UNIT = {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "Tbyte": 1e3}
TIME = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def number(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def main(path):
    launches = OrderedDict()  # id -> {"name", "grid", "block", metrics}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # skip the profiled program's output
    for row in csv.DictReader(lines):
        lid = row.get("ID")
        if lid is None:
            continue
        k = launches.setdefault(lid, {"name": row["Kernel Name"], "grid": row.get("Grid Size", ""),
                                      "block": row.get("Block Size", ""), "m": {}})
        name, unit, val = row["Metric Name"], row.get("Metric Unit", ""), number(row["Metric Value"])
        if val is None:
            continue
        if name == "gpu__time_duration.sum" or name == "Duration":
            k["m"]["us"] = val * TIME.get(unit, 1.0)
        elif name.startswith("dram__bytes"):
            k["m"][name] = val * UNIT.get(unit, 1.0)
        else:
            k["m"][name] = val
    # one row per kernel and grid: the same kernel at other sizes (a short
    # warm-up prefill, another chunk) apart
    by = defaultdict(list)
    for k in launches.values():
        by[(k["name"], k["grid"])].append(k)
    total = sum(k["m"].get("us", 0.0) for k in launches.values())
    head = ["kernel", "launches", "total us", "mean us", "share", "grid", "block"] + [c[0] for c in COLUMNS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    rows = sorted(by.items(), key=lambda kv: -sum(x["m"].get("us", 0.0) for x in kv[1]))
    for (name, _), ks in rows:
        us = sum(x["m"].get("us", 0.0) for x in ks)
        cells = [name, str(len(ks)), f"{us:,.1f}", f"{us / len(ks):,.1f}",
                 f"{100 * us / total:.1f}%" if total else "-", ks[0]["grid"], ks[0]["block"]]
        for _, metric, how in COLUMNS:
            vals = [x["m"][metric] for x in ks if metric in x["m"]]
            if not vals:
                cells.append("-")
            elif how == "sum":
                cells.append(f"{sum(vals):.3f}")
            else:
                cells.append(f"{sum(vals) / len(vals):.1f}")
        print("| " + " | ".join(cells) + " |")
    print(f"\n{len(launches)} launches, {total:,.1f} us in all")


if __name__ == "__main__":
    main(sys.argv[1])
