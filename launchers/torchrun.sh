#!/usr/bin/env bash
# ds_exp under torchrun: N ranks on this node (or on each node: set NNODES, NODE_RANK, MASTER_ADDR).
#   launchers/torchrun.sh 2 zero=stage3 precision=bf16
# Every rank shares rank 0's run directory under outputs/.
set -euo pipefail
nproc=${1:?usage: launchers/torchrun.sh NPROC_PER_NODE [hydra overrides...]}
shift
exec "${PYTHON:-python}" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  --nproc_per_node "$nproc" -m ds_exp "$@"
