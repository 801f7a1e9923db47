#!/usr/bin/env bash
# What llama.cpp RPC costs with no network at all: `localspec bench` on one pair, all local, then with the target's
# layers on a `localspec rpc-server` on this machine (docs/performance.md). Run from the repo root:
#     bash bench/lab/rpc_localhost.sh [extra localspec bench arguments, e.g. --target T.gguf --draft D.gguf]
# Environment: OUT [rpc-localhost] (logs and JSON), PORT [50952], ARGS ["--repeat 5 --warmup 3 --max-tokens 64
# --temp 0"], SERVER_ARGS [""] (e.g. "--threads 1"), LOCALSPEC [localspec]. The RPC run is made with draft-ahead
# on (auto: the draft computes here while the server verifies) and off.
set -euo pipefail
OUT="${OUT:-rpc-localhost}"
PORT="${PORT:-50952}"
ARGS="${ARGS:---repeat 5 --warmup 3 --max-tokens 64 --temp 0}"
SERVER_ARGS="${SERVER_ARGS:-}"
LOCALSPEC="${LOCALSPEC:-localspec}"
mkdir -p "$OUT"
# shellcheck disable=SC2086  # word lists on purpose
$LOCALSPEC bench $ARGS "$@" --json "$OUT/local.json" > "$OUT/local.log" 2>&1
# shellcheck disable=SC2086
$LOCALSPEC rpc-server --port "$PORT" $SERVER_ARGS > "$OUT/server.log" 2>&1 &
server=$!
# TERM, not INT: a background job of a script ignores SIGINT
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
sleep 5
# shellcheck disable=SC2086
$LOCALSPEC bench $ARGS "$@" --rpc "127.0.0.1:$PORT" --json "$OUT/rpc.json" > "$OUT/rpc.log" 2>&1
# shellcheck disable=SC2086
$LOCALSPEC bench $ARGS "$@" --rpc "127.0.0.1:$PORT" --draft-ahead off --json "$OUT/rpc-sequential.json" \
    > "$OUT/rpc-sequential.log" 2>&1
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for name in ("local", "rpc", "rpc-sequential"):
    r = json.loads((Path(sys.argv[1]) / f"{name}.json").read_text())
    p, s, check = r["plain"], r["speculative"], r["greedy_check"]
    same = check.get("identical", check.get("diverged") == 0)
    print(f"{name:<15} plain {p['median_tps']:6.1f} tok/s ({p['min_tps']:.1f}-{p['max_tps']:.1f})   "
          f"speculative {s['median_tps']:6.1f} tok/s ({s['min_tps']:.1f}-{s['max_tps']:.1f}), "
          f"acceptance {s['acceptance_rate']:.0%}, greedy {'identical' if same else 'DIFFERS'}")
PY
