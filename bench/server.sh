# Sourced by the load scripts (load_ab.sh, load_64.sh): one `whiflash serve` at a time on $PORT,
# from a code directory, with the Python of $PY.
#
#   start_server CODE_DIR LOG [ENV=VALUE ...] [-- SERVER ARGS ...]   (returns once /health answers)
#   stop_server

start_server() {
  local dir=$1 log=$2; shift 2
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift   # the "--"
  (cd "$dir" && env "${envs[@]}" PYTHONPATH="$dir" "$PY" -m whiflash_core.cli serve --port "$PORT" "$@" \
     > "$log" 2>&1) &
  SERVER_PID=$!
  for _ in $(seq 300); do curl -sf "localhost:$PORT/health" >/dev/null && return 0; sleep 1; done
  echo "server on port $PORT did not answer /health in 300 s (log: $log)" >&2
}

stop_server() {
  pkill -f "whiflash_core.cli serve --port $PORT" || true
  wait "$SERVER_PID" 2>/dev/null || true
}
