"""After a test tier: its slowest tests across both passes (the JUnit XML files pytest wrote) and
its wall time, so that CI's log shows where the time goes. ``--json FILE`` also writes every
test's time (the durations table kept in benchmarks/results/)."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET


def read(paths: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """node id -> seconds (setup + call + teardown, as JUnit's testcase time), and node id -> CPU
    seconds for the fast tests the tier guard measured (their ``cpu_s`` property)."""
    times, cpu = {}, {}
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as exc:  # a pass interrupted before it wrote its file
            print(f"test_report: {path} not read ({exc})")
            continue
        for case in root.iter("testcase"):
            module = case.get("classname", "").replace(".", "/")
            node = f"{module}.py::{case.get('name')}"
            times[node] = float(case.get("time", 0))
            for prop in case.iter("property"):
                if prop.get("name") == "cpu_s":
                    cpu[node] = float(prop.get("value", 0))
    return times, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("xml", nargs="*")
    ap.add_argument("--tier", default="")
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    times, cpu = read(args.xml)
    slowest = sorted(times.items(), key=lambda kv: -kv[1])[: args.top]
    print(f"\n{args.top} slowest tests of this run (seconds, setup + call + teardown):")
    for node, sec in slowest:
        print(f"{sec:8.2f}  {node}")
    if cpu:
        # the guard fails a fast test over the limit: these are the ones nearest it
        print("\n10 costliest tests of the fast tier (CPU seconds, what the tier guard limits):")
        for node, sec in sorted(cpu.items(), key=lambda kv: -kv[1])[:10]:
            print(f"{sec:8.2f}  {node}")
    minutes, seconds = divmod(args.seconds, 60)
    print(f"\ntier {args.tier}: {len(times)} tests in {minutes} min {seconds:02d} s (wall)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {"tier": args.tier, "wall_s": args.seconds, "tests": times, "fast_cpu_s": cpu},
                fh,
                indent=0,
            )


if __name__ == "__main__":
    main()
