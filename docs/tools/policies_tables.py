#!/usr/bin/python3
"""Markdown tables for docs/POLICIES.md from `kvtier sim --json` output.

Usage: policies_tables.py RESULT.json
Prints, for the plain and the prefix structure, one table of prefix-token hit ratio and one of
block miss ratio (rows: policies, columns: capacity fractions), each with the best online value
per column in bold, then the gap each policy closes between LRU and Belady (prefix structure,
block miss ratio). Pure formatting: reads one file, writes stdout, standard library only.
"""
import json
import sys

ONLINE_EXCLUDED = {"belady"}


def load(path):
    """Returns {(structure, policy): {fraction: result}} and the sorted fractions."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    table, fractions = {}, set()
    for r in doc["results"]:
        key = (r.get("structure", "plain"), r["policy"])
        table.setdefault(key, {})[r["capacity_fraction"]] = r
        fractions.add(r["capacity_fraction"])
    return table, sorted(fractions)


def metric_table(table, fractions, structure, metric, higher_is_better):
    rows = [(p, v) for (s, p), v in table.items() if s == structure]
    best = {}
    for f in fractions:
        vals = [v[f][metric] for p, v in rows if p not in ONLINE_EXCLUDED and f in v]
        if vals:
            best[f] = max(vals) if higher_is_better else min(vals)
    head = "| policy | " + " | ".join(f"{f:.0%}" for f in fractions) + " |"
    out = [head, "|---" * (len(fractions) + 1) + "|"]
    for p, v in rows:
        cells = []
        for f in fractions:
            x = v[f][metric]
            cell = f"{x:.4f}"
            if p not in ONLINE_EXCLUDED and abs(x - best[f]) < 5e-5:
                cell = f"**{cell}**"
            cells.append(cell)
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def gap_table(table, fractions, structure):
    lru, bel = table.get((structure, "lru")), table.get((structure, "belady"))
    if lru is None or bel is None:
        return ""
    out = ["| policy | " + " | ".join(f"{f:.0%}" for f in fractions) + " |",
           "|---" * (len(fractions) + 1) + "|"]
    for (s, p), v in table.items():
        if s != structure or p in ("lru", "belady"):
            continue
        cells = []
        for f in fractions:
            gap = lru[f]["block_miss_ratio"] - bel[f]["block_miss_ratio"]
            closed = (lru[f]["block_miss_ratio"] - v[f]["block_miss_ratio"]) / gap if gap else 0
            cells.append(f"{closed:+.1%}")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    table, fractions = load(sys.argv[1])
    for structure in ("prefix", "plain"):
        if not any(s == structure for s, _ in table):
            continue
        print(f"Prefix-token hit ratio, {structure} structure (higher is better):\n")
        print(metric_table(table, fractions, structure, "prefix_token_hit_ratio", True))
        print(f"\nBlock miss ratio, {structure} structure (lower is better):\n")
        print(metric_table(table, fractions, structure, "block_miss_ratio", False))
        print()
    gaps = gap_table(table, fractions, "prefix")
    if gaps:
        print("Share of the LRU-to-Belady block-miss gap closed, prefix structure:\n")
        print(gaps)


if __name__ == "__main__":
    main()
