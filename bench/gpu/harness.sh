# shellcheck shell=bash
# Shared by the GPU harness scripts (sourced, after T0, RES and BUDGET_S are set): log lines with the seconds since
# T0, the budget left, and `run`, which runs a command only if the budget still has room for it.
exec 3>&1  # log lines go to the call's stdout even from inside a step whose output is redirected to a file
log() { printf '[%4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*" | tee -a "$RES/run.log" >&3; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# run NAME NEED_S CMD...: CMD if NEED_S seconds remain (capped at what remains); its rc.
run() {
    local name="$1" need="$2"; shift 2
    local remain; remain=$(left)
    if (( remain < need )); then log "SKIP $name: ${remain}s left, needs ~${need}s"; return 99; fi
    log "START $name"
    local t; t=$(date +%s)
    timeout --kill-after=10 "$remain" "$@"; local rc=$?
    log "END $name rc=$rc $(( $(date +%s) - t ))s"
    return $rc
}
# use_build: Python finds the carried packages (WORK/pyenv, unless CARRIED_PY=0: a CPU dry run) and localspec
# (REPO); llama_cpp loads WORK's llama.cpp build when there is one.
use_build() {
    if [[ "${CARRIED_PY:-1}" == 1 ]]; then export PYTHONPATH="$WORK/pyenv/py:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    else export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"; fi
    export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
    if [[ -e "$WORK/build/bin/libllama.so" ]]; then
        export LLAMA_CPP_LIB_PATH="$WORK/build/bin"
        export LD_LIBRARY_PATH="$WORK/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
}
