#!/usr/bin/env python3
"""step_trace.py - summary of a generator step trace (EXL_STEP_TRACE=FILE, src/generator/trace.c): where the jobs'
time to first token goes, by bursts of arrivals.

A burst is a run of jobs submitted with gaps under --gap seconds (server_load.py's levels with one request a client:
one burst a level). For each: its jobs, over how long they were submitted, the engine's TTFT (submit -> first token)
p50/p99 in ms and in steps (those that began after the submission, up to the one that gave the token: 1 is the least),
its parts (submit -> admit, admit -> first token), the steps from the first submit to the last first token, the pages
copied at admission and the time the steps took to plan (admission included); --steps lists those steps with their
rows, prompt rows, admissions, copied pages and times.

  EXL_STEP_TRACE=/tmp/trace.txt exl serve ...   (or python3 bench/server_load.py ..., which passes it on)
  python3 bench/step_trace.py /tmp/trace.txt [--steps] [--gap 0.05]
"""
import argparse


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def parse(path):
    steps, jobs = [], []
    with open(path) as f:
        for line in f:
            w = line.split()
            if not w:
                continue
            kv = {w[i]: w[i + 1] for i in range(2, len(w) - 1, 2)}
            if w[0] == "step":
                steps.append({"n": int(w[1]), **{k: (v if k == "ahead" else float(v)) for k, v in kv.items()}})
            elif w[0] == "job":
                jobs.append({"id": int(w[1]), **{k: float(v) for k, v in kv.items()}})
    return steps, jobs


def bursts(jobs, gap):
    out, cur = [], []
    for j in sorted(jobs, key=lambda j: j["submit"]):
        if cur and j["submit"] - cur[-1]["submit"] > gap:
            out.append(cur)
            cur = []
        cur.append(j)
    return out + ([cur] if cur else [])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--gap", type=float, default=0.05, help="seconds between submissions that end a burst")
    ap.add_argument("--steps", action="store_true", help="list each burst's steps")
    a = ap.parse_args()
    steps, jobs = parse(a.trace)
    if not steps:
        raise SystemExit("no steps in the trace")
    dur = sorted(s["end"] - s["begin"] for s in steps)
    print(f"{len(steps)} steps (median {pct(dur, 50) * 1e3:.2f} ms), {len(jobs)} jobs")
    print("| jobs | submitted over ms | TTFT p50 / p99 ms | in steps p50 / p99 | submit->admit p50 / p99 ms |"
          " admit->first p50 / p99 ms | steps | pages copied | planning ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in bursts([j for j in jobs if j["first"] > 0], a.gap):
        t0, t1 = min(j["submit"] for j in b), max(j["first"] for j in b)
        inside = [s for s in steps if s["end"] >= t0 and s["begin"] <= t1]
        spread = max(j["submit"] for j in b) - t0
        plan = sum(s["planned"] - s["begin"] for s in inside)
        ttft = [j["first"] - j["submit"] for j in b]
        nsteps = [sum(1 for s in inside if s["begin"] >= j["submit"] and s["n"] <= j["step_first"]) for j in b]
        sa = [j["admit"] - j["submit"] for j in b]
        af = [j["first"] - j["admit"] for j in b]
        copied = sum(s["copied"] for s in inside)
        print(f"| {len(b)} | {spread * 1e3:.2f} | {pct(ttft, 50) * 1e3:.1f} / {pct(ttft, 99) * 1e3:.1f} | "
              f"{pct(nsteps, 50)} / {pct(nsteps, 99)} | {pct(sa, 50) * 1e3:.2f} / {pct(sa, 99) * 1e3:.2f} | "
              f"{pct(af, 50) * 1e3:.2f} / {pct(af, 99) * 1e3:.2f} | {len(inside)} | {copied:.0f} | {plan * 1e3:.2f} |")
        if a.steps:
            for s in inside:
                print(f"    step {s['n']}: +{(s['begin'] - t0) * 1e3:8.2f} ms, {(s['planned'] - s['begin']) * 1e3:6.2f} ms"
                      f" to plan, {(s['end'] - s['planned']) * 1e3:7.2f} ms to run; rows {s['rows']:.0f}"
                      f" (prompt {s['prompt_rows']:.0f}), seqs {s['seqs']:.0f}, inbox {s['inbox']:.0f},"
                      f" admitted {s['admitted']:.0f}, copied {s['copied']:.0f}, ahead {s['ahead']}")


if __name__ == "__main__":
    main()
