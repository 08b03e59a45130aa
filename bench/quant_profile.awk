#!/usr/bin/awk -f
# quant_profile.awk - sums the EXL_QUANT_PROFILE=1 lines of `exl quantize` (stderr) per pass: layers, wall and CPU
# seconds (all threads), and each part's wall / CPU seconds and entries, largest wall time first.
# Usage: awk -f bench/quant_profile.awk quantize.err
function add(stage, name, v) {
    split(v, wc, "/")
    wall[stage, name] += wc[1]
    cpu[stage, name] += wc[2]
    names[stage, name] = 1
}
/^exl: profile / {
    stage = $3
    layers[stage]++
    split($6, wc, "/")
    total[stage] += wc[1]
    total_cpu[stage] += wc[2]
    for (i = 8; i <= NF; i++) {
        if ($i == "other") {
            v = $(i + 1)
            sub(/;$/, "", v)
            add(stage, "other", v)
            i++
        } else if ($i == "switches") {
            switches[stage] += $(i + 1)
            i++
        } else {
            add(stage, $i, $(i + 1))
            calls = $(i + 2)
            gsub(/[()]/, "", calls)
            count[stage, $i] += calls
            i += 2
        }
    }
}
END {
    for (stage in layers) {
        line = sprintf("%s: %d layers, %.1f s wall / %.1f s CPU (%.2f / %.2f a layer), switches %d:", stage,
                       layers[stage], total[stage], total_cpu[stage], total[stage] / layers[stage],
                       total_cpu[stage] / layers[stage], switches[stage])
        n = 0
        for (key in names) {
            split(key, kv, SUBSEP)
            if (kv[1] == stage)
                order[++n] = kv[2]
        }
        for (a = 1; a <= n; a++) # largest wall time first
            for (b = a + 1; b <= n; b++)
                if (wall[stage, order[b]] > wall[stage, order[a]]) {
                    t = order[a]
                    order[a] = order[b]
                    order[b] = t
                }
        for (a = 1; a <= n; a++)
            line = line sprintf(" %s %.1f/%.1f%s", order[a], wall[stage, order[a]], cpu[stage, order[a]],
                                order[a] == "other" ? "" : sprintf(" (%d)", count[stage, order[a]]))
        print line
    }
}
