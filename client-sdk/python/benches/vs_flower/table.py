"""The comparison's table from bench.py's JSON results: one row per (side, clients)."""

import json
import statistics
import sys

rows = sorted((json.load(open(p)) for p in sys.argv[1:]), key=lambda r: (r["clients"], r["side"]))
print("| side | clients | rounds | s/round (median) | s/round (mean) | wall s | MB/round (down + up) | accuracy after rounds 1, 5, last | peak RSS MiB |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    secs = [x["seconds"] for x in r["rounds"]]
    mb = statistics.mean((x["bytes_down"] + x["bytes_up"]) / 1e6 for x in r["rounds"])
    acc = r["accuracy"]
    picks = ", ".join(f"{acc[i]:.3f}" for i in sorted({1, min(5, len(acc) - 1), len(acc) - 1}))
    rss = f"{r['peak_rss_mib']:.0f}" if "peak_rss_mib" in r else "–"
    print(f"| {r['side']} | {r['clients']} | {len(secs)} | {statistics.median(secs):.2f} | {statistics.mean(secs):.2f} | "
          f"{r['wall_seconds']:.1f} | {mb:.2f} | {picks} | {rss} |")
