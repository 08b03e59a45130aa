#!/usr/bin/env python3
"""Plot perplexity against bits per weight from the CSV that bench/quant_ppl.sh writes.

usage: bench/plot_ppl.py CSV [SVG]   (SVG defaults to bench/quant_ppl.svg next to this script)

EXL2 points are joined by a line, GPTQ and RTN are separate markers, the unquantized model is a
horizontal dashed line; the y axis is logarithmic. Standard library only; the SVG is written by hand.
"""
import csv
import math
import os
import sys

W, H = 680, 420
L, R, T, B = 64, 190, 40, 52  # margins: plot area is [L, W-R] x [T, H-B]


def nice_ticks(lo, hi, n=6):
    """Round tick values covering [lo, hi], about n of them."""
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, v = [], first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 10))
        v += step
    if ticks[-1] < hi:
        ticks.append(round(v, 10))
    return ticks


def fmt(v):
    return f"{v:g}"


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.strip().splitlines()[2])
    out = sys.argv[2] if len(sys.argv) == 3 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_ppl.svg")
    with open(sys.argv[1], newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok" and r["perplexity"]]
    ref = next((float(r["perplexity"]) for r in rows if r["kind"] == "fp32"), None)
    pts = {k: sorted((float(r["bpw"]), float(r["perplexity"]), r["format"]) for r in rows if r["kind"] == k)
           for k in ("exl2", "gptq", "rtn")}
    allp = [p for v in pts.values() for p in v]
    if not allp:
        sys.exit("no quantized results in the CSV")

    xt = nice_ticks(math.floor(min(p[0] for p in allp) * 2) / 2, math.ceil(max(p[0] for p in allp) * 2) / 2, 8)
    ys = [p[1] for p in allp] + ([ref] if ref else [])
    # log y axis, so that the points near fp32 stay apart; ticks thinned to >= 18 px
    y0, y1 = math.log(min(ys) * 0.97), math.log(max(ys) * 1.03)

    def X(v):
        return L + (v - x0) / (x1 - x0) * (W - L - R)

    def Y(v):
        return H - B - (math.log(v) - y0) / (y1 - y0) * (H - T - B)

    x0, x1 = xt[0], xt[-1]
    yt = []
    for v in nice_ticks(math.exp(y0), math.exp(y1), 15):
        if math.exp(y0) <= v <= math.exp(y1) and (not yt or Y(yt[-1]) - Y(v) >= 18):
            yt.append(v)

    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
         'font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{(L + W - R) / 2}" y="22" text-anchor="middle" font-size="14">'
         'tinystories-656k: perplexity against bits per weight</text>']
    for v in xt:  # grid, ticks and labels
        s.append(f'<line x1="{X(v):.1f}" y1="{T}" x2="{X(v):.1f}" y2="{H - B}" stroke="#e4e4e4"/>')
        s.append(f'<text x="{X(v):.1f}" y="{H - B + 16}" text-anchor="middle">{fmt(v)}</text>')
    for v in yt:
        s.append(f'<line x1="{L}" y1="{Y(v):.1f}" x2="{W - R}" y2="{Y(v):.1f}" stroke="#e4e4e4"/>')
        s.append(f'<text x="{L - 6}" y="{Y(v) + 4:.1f}" text-anchor="end">{fmt(v)}</text>')
    s.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#333"/>')
    s.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">'
             'bits per weight (decoder layers, as stored)</text>')
    s.append(f'<text transform="translate(18 {(T + H - B) / 2}) rotate(-90)" text-anchor="middle">'
             'perplexity (log scale; ctx 256, 64 windows)</text>')

    legend = []
    if ref:
        s.append(f'<line x1="{L}" y1="{Y(ref):.1f}" x2="{W - R}" y2="{Y(ref):.1f}" stroke="#555" '
                 'stroke-width="1.5" stroke-dasharray="6 4"/>')
        legend.append(("line-dash", "#555", f"fp32 ({ref:.2f})"))
    if pts["exl2"]:
        path = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y, _ in pts["exl2"])
        s.append(f'<polyline points="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
        for x, y, name in pts["exl2"]:
            s.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="4" fill="#1f77b4"><title>{name}: {y:.3f}</title></circle>')
        legend.append(("circle", "#1f77b4", "EXL2 (head 6 bits)"))
    for x, y, name in pts["gptq"]:
        s.append(f'<rect x="{X(x) - 5:.1f}" y="{Y(y) - 5:.1f}" width="10" height="10" fill="none" stroke="#d62728" stroke-width="2">'
                 f'<title>{name}: {y:.3f}</title></rect>')
    if pts["gptq"]:
        legend.append(("square", "#d62728", "GPTQ 4b g128 act-order"))
    for x, y, name in pts["rtn"]:
        s.append(f'<path d="M{X(x):.1f},{Y(y) - 6:.1f} L{X(x) + 6:.1f},{Y(y) + 5:.1f} L{X(x) - 6:.1f},{Y(y) + 5:.1f} Z" '
                 f'fill="none" stroke="#2ca02c" stroke-width="2"><title>{name}: {y:.3f}</title></path>')
    if pts["rtn"]:
        legend.append(("triangle", "#2ca02c", "RTN 4b g128"))

    lx, ly = W - R + 12, T + 10
    for i, (shape, color, label) in enumerate(legend):
        cy = ly + i * 20
        if shape == "line-dash":
            s.append(f'<line x1="{lx}" y1="{cy}" x2="{lx + 20}" y2="{cy}" stroke="{color}" stroke-width="1.5" '
                     'stroke-dasharray="6 4"/>')
        elif shape == "circle":
            s.append(f'<line x1="{lx}" y1="{cy}" x2="{lx + 20}" y2="{cy}" stroke="{color}" stroke-width="2"/>')
            s.append(f'<circle cx="{lx + 10}" cy="{cy}" r="4" fill="{color}"/>')
        elif shape == "square":
            s.append(f'<rect x="{lx + 5}" y="{cy - 5}" width="10" height="10" fill="none" stroke="{color}" stroke-width="2"/>')
        else:
            s.append(f'<path d="M{lx + 10},{cy - 6} L{lx + 16},{cy + 5} L{lx + 4},{cy + 5} Z" fill="none" stroke="{color}" stroke-width="2"/>')
        s.append(f'<text x="{lx + 26}" y="{cy + 4}" font-size="11">{label}</text>')
    s.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(s) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
