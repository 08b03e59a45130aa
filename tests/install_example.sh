#!/usr/bin/env bash
# install_example.sh EXL_BINARY SHARED_DIR - `cmake --install` of the build that made EXL_BINARY into a fresh
# prefix: exl, libexl.a, libexl.so.MAJOR.MINOR.PATCH with its soname links, exl.h, exl.pc and the embedded model
# are there; examples/generate.c builds against the installed library through pkg-config, shared and static, and
# both print the reference greedy text; the installed exl finds the model installed beside it.
set -euo pipefail
build=$(cd "$(dirname "$1")" && pwd)
shared=$2
root=$(cd "$(dirname "$0")/.." && pwd)
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
passed=0
fail() {
    echo "install_example: FAILED: $*" >&2
    exit 1
}
ok() { passed=$((passed + 1)); }

cmake --install "$build" --prefix "$prefix" >"$prefix/install.log" || fail "cmake --install: $(cat "$prefix/install.log")"
pc=$(find "$prefix" -name exl.pc)
[ -n "$pc" ] || fail "no exl.pc installed"
libdir=$(dirname "$(dirname "$pc")")
version=$(sed -n 's/^#define EXL_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' "$root/include/exl.h" | paste -sd.)
for f in bin/exl include/exl.h share/exl/models/tinystories-656k/model.safetensors \
    share/exl/models/tinystories-656k/LICENSE; do
    [ -f "$prefix/$f" ] || fail "$f is not installed"
done
for f in libexl.a "libexl.so.$version" libexl.so "libexl.so.${version%.*}"; do
    [ -e "$libdir/$f" ] || fail "$libdir/$f is not installed"
done
soname=$(objdump -p "$libdir/libexl.so.$version" | awk '/SONAME/ {print $2}')
[ "$soname" = "libexl.so.${version%.*}" ] || fail "soname is '$soname', wanted libexl.so.${version%.*}"
ok

export PKG_CONFIG_PATH="$libdir/pkgconfig"
[ "$(pkg-config --modversion exl)" = "$version" ] || fail "pkg-config --modversion exl: $(pkg-config --modversion exl)"
cc=${CC:-cc}
# a sanitizer build's library needs its runtime in the program too
sanitize=
if nm "$libdir/libexl.a" 2>/dev/null | grep __asan_ >/dev/null; then
    sanitize=-fsanitize=address,undefined
fi
# shared: the library found by its soname through the rpath
"$cc" $sanitize -std=c11 -Wall -Wextra -Werror "$root/examples/generate.c" $(pkg-config --cflags --libs exl) \
    -Wl,-rpath,"$libdir" -o "$prefix/generate" || fail "examples/generate.c does not build against libexl.so"
# static: libexl.a and what pkg-config --static adds
"$cc" $sanitize -std=c11 -Wall -Wextra -Werror "$root/examples/generate.c" $(pkg-config --cflags exl) "$libdir/libexl.a" \
    $(pkg-config --static --libs exl | sed 's/-lexl\b//') -o "$prefix/generate-static" ||
    fail "examples/generate.c does not build against libexl.a"
libs=$(ldd "$prefix/generate")
grep -q "libexl.so.${version%.*} => $libdir/" <<<"$libs" || fail "generate does not load the installed libexl"
libs=$(ldd "$prefix/generate-static")
grep -q libexl <<<"$libs" && fail "generate-static still loads libexl.so"
ok

want=$(python3 -c 'import json, sys
for p in json.load(open(sys.argv[1]))["prompts"]:
    if p["prompt"] == "Once upon a time":
        print(p["greedy_text"])' "$shared/reference/tinystories-656k.json")
model="$prefix/share/exl/models/tinystories-656k"
for prog in generate generate-static; do
    got=$("$prefix/$prog" "$model" "Once upon a time") || fail "$prog exited $?"
    case "$want" in "$got"*) ;; *) fail "$prog printed '$got', not the start of the reference '$want'" ;; esac
    [ ${#got} -gt 100 ] || fail "$prog printed only '$got'"
done
ok

help=$("$prefix/bin/exl" run --help) # whole: grep -q would leave the writer a SIGPIPE, a failure under pipefail
grep -q "default $prefix/bin/../share/exl/models/tinystories-656k" <<<"$help" ||
    fail "the installed exl does not take the model installed beside it"
"$prefix/bin/exl" run -p "Once upon a time" -n 8 -t 1 >/dev/null || fail "the installed exl cannot run without -m"
ok
echo "install_example: $passed passed, 0 failed"
