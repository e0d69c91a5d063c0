#!/usr/bin/env bash
# The prepared GPU check of the torch backend (issue 21). Without a CUDA device it prints
# "no CUDA device" and exits 0. With one it runs, in under 8 minutes on one H200:
#   1. the conformance subset on cuda:0 (every plan device mapped onto one GPU, a stream each;
#      a memory cap offloading to pinned host memory): tests/test_torch_backend.py -k cuda;
#   2. the LLaMA-7B block prefill (bf16, seq 2048, batch 1 and 8) on one device: einjoin's torch
#      backend vs torch eager and torch.compile, measured in the same process, plus the block
#      under a memory cap of half its working set vs uncapped;
# and prints one table. Written without a GPU: never run yet (see the issue's closing note).
# The einjoin run's time includes the host round trip Program.run makes today (a CUDA tensor fed
# to run() is bound as a host array, and results come back as host arrays); "engine" is the
# engine's own wall time (RunStats.wall_time), uploads of the input included.
#
# Usage: bench/gpu_check.sh   (from the repository root; PYTHON overrides the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no CUDA device"
    exit 0
fi

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
start=$(date +%s)

# 1. conformance subset on cuda:0 (bounded: 4 minutes)
timeout 240 "$PY" -m pytest -q -n 0 -p no:cacheprovider tests/test_torch_backend.py -k cuda \
    > "$OUT/conformance.txt" 2>&1
echo $? > "$OUT/conformance.rc"

# 2. the LLaMA-7B block (bounded: the rest of 8 minutes)
left=$(( 470 - ($(date +%s) - start) ))
timeout "$left" "$PY" - "$OUT" <<'PYEOF' > "$OUT/llama.txt" 2>&1
import json, statistics, sys, time

import torch

import einjoin as ej
from einjoin.models.zoo import LLAMA_7B, LlamaBlock
from einjoin.runtime.backends.torch_backend import TorchBackend

out_dir = sys.argv[1]
rows = []
torch.manual_seed(0)
module = LlamaBlock(LLAMA_7B).eval().to(torch.bfloat16).cuda()


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


compiled = torch.compile(module)
for batch in (1, 8):
    x = torch.randn(batch, LLAMA_7B.seq, LLAMA_7B.dim, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        eager_s = timed(lambda: module(x))
        want = module(x)
        comp_s = timed(lambda: compiled(x))
    fn = ej.from_torch(module, (x,))  # its weights bound as host arrays: uploaded once (cache_feeds)
    backend = TorchBackend(device_map="cuda", cache_feeds=True)
    prog = ej.compile(fn, devices=1, backend=backend, quiet=True)
    got = prog.run(x)
    err = float((got.float().cuda() - want.float()).abs().max() / want.float().abs().max())
    ej_s = timed(lambda: prog.run(x))
    engine_s = prog.run_stats.wall_time  # the engine's run, without binding and the host round trip
    peak = max(prog.run_stats.peak_bytes_per_device.values())
    try:  # under a cap of half the working set: blocks go to pinned host memory and back
        capped = ej.compile(fn, devices=1, backend=TorchBackend(device_map="cuda", cache_feeds=True),
                            memory_limit=peak // 2, quiet=True)
        capped.run(x)
        cap_s, evicted = timed(lambda: capped.run(x), reps=5), capped.run_stats.bytes_evicted / 1e6
    except Exception as e:  # the rest of the table still prints
        print(f"capped run failed: {type(e).__name__}: {e}"[:2000], file=sys.stderr)
        cap_s, evicted = float("nan"), float("nan")
    rows.append(dict(batch=batch, eager_ms=eager_s * 1e3, compile_ms=comp_s * 1e3, einjoin_ms=ej_s * 1e3,
                     engine_ms=engine_s * 1e3, capped_ms=cap_s * 1e3, rel_err=err, evicted_mb=evicted))
    json.dump(rows, open(f"{out_dir}/llama.json", "w"))  # after each batch: a timeout keeps what ran
json.dump(rows, open(f"{out_dir}/llama.json", "w"))
PYEOF
echo $? > "$OUT/llama.rc"

"$PY" - "$OUT" <<'PYEOF'
import json, os, sys

out = sys.argv[1]
import torch
print(f"GPU check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
print(f"{'check':<44} {'result':>48}")
rc = open(f"{out}/conformance.rc").read().strip()
tail = [l for l in open(f"{out}/conformance.txt").read().splitlines() if l.strip()][-1:]
print(f"{'conformance subset on cuda:0 (rc ' + rc + ')':<44} {(tail[0] if tail else '?')[:48]:>48}")
if os.path.exists(f"{out}/llama.json"):
    for r in json.load(open(f"{out}/llama.json")):
        b = r["batch"]
        print(f"{f'LLaMA-7B block bf16 seq 2048 batch {b}':<44} {'':>48}")
        print(f"{'  torch eager / torch.compile (ms)':<44} {r['eager_ms']:>22.2f} {r['compile_ms']:>25.2f}")
        print(f"{'  einjoin torch backend (ms, run / engine)':<44} {r['einjoin_ms']:>22.2f} {r['engine_ms']:>25.2f}")
        print(f"{'  einjoin / torch eager (run, engine)':<44} {r['einjoin_ms'] / r['eager_ms']:>22.2f} "
              f"{r['engine_ms'] / r['eager_ms']:>25.2f}")
        print(f"{'  capped at half the peak / uncapped':<44} {r['capped_ms'] / r['einjoin_ms']:>22.2f} "
              f"{str(r['evicted_mb'] if r['evicted_mb'] != r['evicted_mb'] else round(r['evicted_mb'])) + ' MB evicted':>25}")
        print(f"{'  max error / max |torch eager|':<44} {r['rel_err']:>48.1e}")
llama_rc = open(f"{out}/llama.rc").read().strip()
if llama_rc != "0" or not os.path.exists(f"{out}/llama.json"):
    print(f"{'LLaMA-7B block (rc ' + llama_rc + ')':<44} {'incomplete: its log follows':>48}")
    print(open(f"{out}/llama.txt").read()[-3000:])
if rc != "0":
    print(open(f"{out}/conformance.txt").read()[-3000:])
PYEOF
