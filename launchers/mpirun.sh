#!/usr/bin/env bash
# ds_exp under OpenMPI's mpirun: N ranks (ranks come from OMPI_COMM_WORLD_*; MPICH's PMI_* work too).
#   launchers/mpirun.sh 2 zero=stage3 precision=bf16
# Several nodes: MPIRUN_ARGS="--hostfile hosts" and MASTER_ADDR=<the first host>.
set -euo pipefail
nproc=${1:?usage: launchers/mpirun.sh NPROCS [hydra overrides...]}
shift
root=()
if [[ $EUID -eq 0 ]]; then root=(--allow-run-as-root); fi
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500}
# shellcheck disable=SC2086  # MPIRUN_ARGS is a list of words on purpose
exec mpirun "${root[@]}" --oversubscribe -np "$nproc" ${MPIRUN_ARGS:-} \
  -x MASTER_ADDR -x MASTER_PORT -x PYTHONPATH -x WANDB_MODE \
  "${PYTHON:-python}" -m ds_exp "$@"
