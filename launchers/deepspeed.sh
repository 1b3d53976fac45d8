#!/usr/bin/env bash
# ds_exp under the deepspeed launcher: N ranks on this node (a hostfile for several: HOSTFILE=path).
#   launchers/deepspeed.sh 2 zero=stage3 precision=bf16
# The launcher appends --local_rank=N to the arguments; ds_exp strips it before Hydra parses them.
# --log_level error: the launcher's own notices (each process it spawns, with its command line) are left out; a
# rank's exit status still is one line after the rank's own message.
set -euo pipefail
nproc=${1:?usage: launchers/deepspeed.sh NPROC_PER_NODE [hydra overrides...]}
shift
# what a stopped run prints to continue it: this script, as it was typed (ds_exp/train/session.py)
export DS_EXP_RELAUNCH="${DS_EXP_RELAUNCH:-$0 $nproc}"
hostfile=()
if [[ -n "${HOSTFILE:-}" ]]; then hostfile=(--hostfile "$HOSTFILE"); fi
exec deepspeed "${hostfile[@]}" --log_level error --num_gpus "$nproc" --master_port "${MASTER_PORT:-29500}" --module ds_exp "$@"
