#!/usr/bin/env bash
# ds_exp under torchrun: N ranks on this node (or on each node: set NNODES, NODE_RANK, MASTER_ADDR).
#   launchers/torchrun.sh 2 zero=stage3 precision=bf16
# Every rank shares rank 0's run directory under outputs/. torchrun's own end of a failed launch (its 30-line
# report) is left out: the failed rank's message is the last line, and its exit status the script's
# (ds_exp/tools/torchrun.py). OMP_NUM_THREADS=1 unless set, as torchrun would set it (without its banner).
set -euo pipefail
nproc=${1:?usage: launchers/torchrun.sh NPROC_PER_NODE [hydra overrides...]}
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# what a stopped run prints to continue it: this script, as it was typed (ds_exp/train/session.py)
export DS_EXP_RELAUNCH="${DS_EXP_RELAUNCH:-$0 $nproc}"
exec "${PYTHON:-python}" -m ds_exp.tools.torchrun \
  --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  --nproc_per_node "$nproc" -m ds_exp "$@"
