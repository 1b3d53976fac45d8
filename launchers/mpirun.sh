#!/usr/bin/env bash
# ds_exp under OpenMPI's mpirun: N ranks (ranks come from OMPI_COMM_WORLD_*; MPICH's PMI_* work too).
#   launchers/mpirun.sh 2 zero=stage3 precision=bf16
# Several nodes: MPIRUN_ARGS="--hostfile hosts" and MASTER_ADDR=<the first host>.
# --quiet: mpirun's own report of a rank's non-zero exit is left out (the rank said why, once for all ranks);
# the script's exit status is the rank's.
set -euo pipefail
nproc=${1:?usage: launchers/mpirun.sh NPROCS [hydra overrides...]}
shift
root=()
if [[ $EUID -eq 0 ]]; then root=(--allow-run-as-root); fi
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500}
# what a stopped run prints to continue it: this script, as it was typed (ds_exp/train/session.py)
export DS_EXP_RELAUNCH="${DS_EXP_RELAUNCH:-$0 $nproc}"
passed=()  # the variables the ranks need, those that are set (mpirun warns about each one that is not)
for name in MASTER_ADDR MASTER_PORT PYTHONPATH WANDB_MODE DS_EXP_RELAUNCH; do
  if [[ -n "${!name+x}" ]]; then passed+=(-x "$name"); fi
done
# shellcheck disable=SC2086  # MPIRUN_ARGS is a list of words on purpose
exec mpirun "${root[@]}" --quiet --oversubscribe -np "$nproc" ${MPIRUN_ARGS:-} "${passed[@]}" \
  "${PYTHON:-python}" -m ds_exp "$@"
