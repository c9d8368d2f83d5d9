#!/usr/bin/env bash
# ik_llama.cpp's CPU build beside hybridmoe, everything on the CPU, on the same synth files: the peer whose CPU
# kernels are made for the users' types (IQ4_KS, IQ2_KT, IQ4_XS, the K-quant mixes), side by side in one call.
#
# Here (once; the source from `fetch github:ikawrakow/ik_llama.cpp`, the mirror's path as MIRROR):
#   bash benchmarks/ik_peer.sh pack MIRROR      -> .carry/ik-src.tgz (ggml, src, common and llama-bench; ik's
#                                                  other examples, tests and model files left out)
# On the GPU machine (carry .carry):
#   bash benchmarks/ik_peer.sh run PRESET...    e.g. qwen3-30b-a3b qwen3-30b-a3b-iq4_ks
# builds llama-bench (CPU only, native flags) into /tmp/ikb unless .carry/ik-llama-bench (a binary an earlier
# call sent back as $OUT/ik-llama-bench) runs there; then per preset: the synth file, ik's llama-bench with
# -rtr 0 and -rtr 1 (its run-time repacking into the interleaved _R4/_R8 types), hybridmoe's bench with no GPU
# visible, alternated twice; the file is deleted after its rows (the machine's disk holds three or four).
# Each: -t 16 -p 512 -n 64 -r 2 (TG, PP, ROUNDS and THREADS overridable; PP=0: decode only). A PRESET that is a
# file's path runs that file (kept). IK_BIN: a llama-bench built elsewhere (e.g. here, for the dev VM's CPU).
set -e
cmd=$1
shift
if [ "$cmd" = pack ]; then
  m=$1
  t=$(mktemp -d)
  git --git-dir="$m" --work-tree="$t" checkout HEAD -- CMakeLists.txt cmake common ggml include src vendor/cpp-httplib \
    vendor/nlohmann vendor/stb vendor/sheredom examples/llama-bench
  # only llama-bench of the examples, no proofs of concept
  printf 'find_package(Threads REQUIRED)\ninclude_directories(${CMAKE_CURRENT_SOURCE_DIR})\nadd_subdirectory(llama-bench)\n' \
    > "$t/examples/CMakeLists.txt"
  sed -i 's/^    add_subdirectory(pocs)/    # pocs: not in this build/' "$t/CMakeLists.txt"
  echo "ik_llama.cpp $(git --git-dir="$m" rev-parse HEAD)" > "$t/PEER_COMMIT"
  mkdir -p .carry && tar czf .carry/ik-src.tgz -C "$t" . && rm -rf "$t"
  ls -la .carry/ik-src.tgz
  exit 0
fi
[ "$cmd" = run ] || { echo "usage: ik_peer.sh pack MIRROR | run PRESET..."; exit 2; }
source benchmarks/device_setup.sh
set +e
TG=${TG:-64}
PP=${PP:-512}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-16}
BIN=/tmp/ik-llama-bench
if [ -n "${IK_BIN:-}" ]; then
  cp "$IK_BIN" $BIN
elif [ -x .carry/ik-llama-bench ] && .carry/ik-llama-bench --help >/dev/null 2>&1; then
  cp .carry/ik-llama-bench $BIN
else
  rm -rf /tmp/ik /tmp/ikb && mkdir -p /tmp/ik && tar xzf .carry/ik-src.tgz -C /tmp/ik && cat /tmp/ik/PEER_COMMIT
  start=$(date +%s)
  cmake -S /tmp/ik -B /tmp/ikb -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF >/tmp/ik-cmake.log 2>&1 \
    || { tail -20 /tmp/ik-cmake.log; exit 1; }
  ninja -C /tmp/ikb -j 16 llama-bench >/tmp/ik-build.log 2>&1 || { grep -m5 -B2 -A5 "error" /tmp/ik-build.log; exit 1; }
  echo "ik_llama.cpp llama-bench built in $(( $(date +%s) - start )) s"
  cp /tmp/ikb/bin/llama-bench $BIN
  [ -n "${OUT:-}" ] && cp $BIN "$OUT/ik-llama-bench"
fi
for p in "$@"; do
  if [ -f "$p" ]; then f=$p; else f=$(python3 -m hybridmoe.cli synth "$p" 2>&1 | tail -1); fi
  echo "=============== $p: $f ($(du -h "$f" | cut -f1))"
  for round in $(seq "$ROUNDS"); do
    for rtr in 0 1; do
      echo "### ik_llama.cpp -rtr $rtr, round $round"
      timeout 240 $BIN -m "$f" -t "$THREADS" -ngl 0 -p "$PP" -n "$TG" -r 2 -rtr $rtr 2>&1 | grep -E "^\| .*(pp|tg)[0-9]"
    done
    echo "### hybridmoe, round $round"
    CUDA_VISIBLE_DEVICES= timeout 240 python3 -m hybridmoe.cli bench -m "$f" -t "$THREADS" -ngl 0 -p "$PP" -n "$TG" -r 2 2>&1 \
      | grep -E "^\| .*(pp|tg)[0-9]"
  done
  [ -f "$p" ] || rm -f "$f"
done
