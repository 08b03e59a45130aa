#!/usr/bin/awk -f
# quant_profile.awk - sums the EXL_QUANT_PROFILE=1 lines of `exl quantize` (stderr) per pass: layers, seconds, and each
# part's seconds and entries, largest first. Usage: awk -f bench/quant_profile.awk quantize.err
/^exl: profile / {
    stage = $3
    sub(/:$/, "", $5)
    layers[stage]++
    total[stage] += $6
    for (i = 8; i <= NF; i++) {
        name = $i
        if (name == "other") {
            sec = $(i + 1)
            sub(/;$/, "", sec)
            part[stage, "other"] += sec
            names[stage, "other"] = 1
            i++
        } else if (name == "switches") {
            switches[stage] += $(i + 1)
            i++
        } else {
            part[stage, name] += $(i + 1)
            calls = $(i + 2)
            gsub(/[()]/, "", calls)
            count[stage, name] += calls
            names[stage, name] = 1
            i += 2
        }
    }
}
END {
    for (stage in layers) {
        line = sprintf("%s: %d layers, %.1f s (%.2f s a layer), switches %d:", stage, layers[stage], total[stage],
                       total[stage] / layers[stage], switches[stage])
        n = 0
        for (key in names) {
            split(key, kv, SUBSEP)
            if (kv[1] == stage)
                order[++n] = kv[2]
        }
        for (a = 1; a <= n; a++) # largest first
            for (b = a + 1; b <= n; b++)
                if (part[stage, order[b]] > part[stage, order[a]]) {
                    t = order[a]
                    order[a] = order[b]
                    order[b] = t
                }
        for (a = 1; a <= n; a++)
            line = line sprintf(" %s %.1f%s", order[a], part[stage, order[a]],
                                order[a] == "other" ? "" : sprintf(" (%d)", count[stage, order[a]]))
        print line
    }
}
