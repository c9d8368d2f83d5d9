#!/usr/bin/env bash
# Source on the GPU machine: puts hybridmoe and the carried wheels (gguf) on the path; no network there.
set -eo pipefail
export PYTHONUNBUFFERED=1
export HYBRIDMOE_CACHE=/tmp/hybridmoe-cache
mkdir -p /tmp/hm-site
if [ ! -e /tmp/hm-site/gguf ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/hm-site .carry/wheels/*.whl >/dev/null 2>&1 \
    || python3 -c "import zipfile,glob; [zipfile.ZipFile(w).extractall('/tmp/hm-site') for w in glob.glob('.carry/wheels/*.whl')]"
fi
export PYTHONPATH="$PWD/src:/tmp/hm-site:${PYTHONPATH:-}"
hm() { python3 -m hybridmoe.cli "$@"; }
python3 -c "import torch, gguf, hybridmoe; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
# CPU kernels built on an earlier machine of the same kind (.carry/kcache, from a run's $OUT): the cache key
# holds the source, the flags and the CPU's features, so a stale or foreign build is simply not found
if [ -d .carry/kcache ]; then mkdir -p "$HYBRIDMOE_CACHE/kernels" && cp -n .carry/kcache/*.so "$HYBRIDMOE_CACHE/kernels/" 2>/dev/null || true; fi
# build them now (or find them), give the sections that use their own cache folder (/tmp/hm-test) the same
# build, and send it back as $OUT/kcache.tar (one file) for .carry/kcache
python3 -c "from hybridmoe.kernels import cpu; assert cpu._load()" || echo "CPU kernels: build failed"
mkdir -p /tmp/hm-test/kernels && cp -n "$HYBRIDMOE_CACHE"/kernels/*.so /tmp/hm-test/kernels/ 2>/dev/null || true
if [ -n "${OUT:-}" ] && [ ! -e "$OUT/kcache.tar" ]; then
  ( cd "$HYBRIDMOE_CACHE/kernels" && tar cf "$OUT/kcache.tar" $(ls -t *.so | head -1) ) 2>/dev/null || true
fi
