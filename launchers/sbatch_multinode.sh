#!/usr/bin/env bash
# One distributed run over several nodes, submitted by hand (no Hydra launcher): srun starts one task per rank,
# ds_exp reads SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS and uses the first node as MASTER_ADDR.
#   sbatch launchers/sbatch_multinode.sh zero=stage3 precision=bf16
#   sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 launchers/sbatch_multinode.sh zero=stage3
# The run directory is outputs/sbatch/<job id> (shared storage across the nodes).
#SBATCH --job-name=ds_exp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=04:00:00
#SBATCH --output=ds_exp-%j.out
set -euo pipefail
# a port derived from the job id, so two jobs sharing a node do not collide
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
srun "${PYTHON:-python}" -m ds_exp "hydra.run.dir=outputs/sbatch/${SLURM_JOB_ID}" "$@"
