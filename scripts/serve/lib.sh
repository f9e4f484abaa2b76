# Shell functions the serve smokes source (openai_smoke.sh, guidellm_smoke.sh).

# wait_gone PID TENTHS: 0 once PID has exited, 1 while it still runs after TENTHS tenths
# of a second.
wait_gone() {
  for _ in $(seq 1 "$2"); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
  ! kill -0 "$1" 2>/dev/null
}

# stop_server PID: SIGTERM, then SIGKILL when it still runs 5 s later (a stopped or stuck
# server would otherwise outlive the script).
stop_server() {
  kill "$1" 2>/dev/null || true
  wait_gone "$1" 50 || kill -KILL "$1" 2>/dev/null || true
}
