#!/usr/bin/env sh
# Print the ATEN_CPU_CAPABILITY values this CPU can run, one per line: `default` always, `avx2`
# where PyTorch would pick it (avx2 and fma), `avx512` where it would (avx512f, bw, vl, dq).
# `make test-variants` runs the parity tests under each. Arguments: --skip-native leaves out the
# highest one (what PyTorch runs when nothing is forced: `make test` has just tested it); a
# cpuinfo file to read instead of /proc/cpuinfo (for tests).
skip_native=0
if [ "${1:-}" = "--skip-native" ]; then skip_native=1; shift; fi
info=${1:-/proc/cpuinfo}
flags=" $(grep -m1 '^flags' "$info" 2>/dev/null | cut -d: -f2) "
has() { for f in "$@"; do case "$flags" in *" $f "*) ;; *) return 1;; esac; done; }
caps=default
case "$(uname -m)" in
  x86_64|amd64|AMD64)
    has avx2 fma && caps="$caps avx2"
    has avx512f avx512bw avx512vl avx512dq fma && caps="$caps avx512";;
esac
if [ $skip_native = 1 ]; then caps=$(echo $caps | awk '{ NF--; print }'); fi
for c in $caps; do echo "$c"; done
