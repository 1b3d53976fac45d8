#!/usr/bin/env bash
# ds_exp on a bare CUDA machine without network (one that has Python 3.12, a CUDA torch and transformers):
#   bench/gpu_setup.sh download .whl     # on a machine that reaches PyPI: wheels + sdists into .whl/
#   bench/gpu_setup.sh install .whl      # on the GPU machine: install them into its own Python, then ds_exp
#   python -m bench.gpu_check            # then: GPU tests, the user's lines, the throughput benchmark (<= 640 s)
# The GPU machine has no network: download where PyPI answers, into a folder inside the checkout that git does not
# ignore (e.g. .whl/), so that it travels with the working tree; install there takes ~30 s.
# The package list is what such a machine lacked (torch 2.11+cu130, transformers 5.17, peft, accelerate, triton,
# pyarrow, pandas present). DeepSpeed is installed from its sdist with DS_BUILD_OPS=0: its ops compile on first use.
set -euo pipefail
cmd=${1:?usage: bench/gpu_setup.sh download|install DIR}
dir=${2:?usage: bench/gpu_setup.sh download|install DIR}
PY=${PYTHON:-python3}
# the versions CI tests against (pydantic-core must be the one pydantic pins)
WHEELS=(
  hydra-core==1.3.8 omegaconf==2.3.1 hydra-submitit-launcher==1.2.0 submitit==1.5.4 cloudpickle==2.1.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 hjson==3.1.0
  ninja==1.13.2 py-cpuinfo==9.0.0 msgpack==1.2.4 pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0
  pytest-xdist==3.8.0 execnet==2.1.2
  liger-kernel==0.8.5  # ds_exp's gpu extra: the fast path's kernels (pure Python; triton comes with CUDA torch)
)
SDISTS=(deepspeed==0.19.8 antlr4-python3-runtime==4.9.3)

case "$cmd" in
  download)
    mkdir -p "$dir"
    $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$dir" "${WHEELS[@]}"
    $PY -m pip download --no-deps --no-binary=:all: -d "$dir" "${SDISTS[@]}"
    ;;
  install)
    # only what the machine lacks: a wheel of a package already there is skipped, so its own torch stays
    missing=()
    for whl in "$dir"/*.whl; do
      name=$(basename "$whl" | cut -d- -f1 | tr _ -)
      $PY -m pip show -q "$name" >/dev/null 2>&1 || missing+=("$whl")
    done
    if ((${#missing[@]})); then $PY -m pip install -q --no-index --no-deps "${missing[@]}"; fi
    $PY -m pip install -q --no-index --no-deps --no-build-isolation "$dir"/antlr4-python3-runtime-*.tar.gz
    src=$(mktemp -d)
    tar -xzf "$dir"/deepspeed-*.tar.gz -C "$src"
    (cd "$src"/deepspeed-* && DS_BUILD_OPS=0 $PY -m pip install -q --no-index --no-deps --no-build-isolation .)
    rm -rf "$src"
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e "$(dirname "$0")/.."
    $PY -c "import deepspeed, hydra, datasets, ds_exp; print('ds_exp ready: deepspeed', deepspeed.__version__)"
    ;;
  *) echo "usage: $0 download|install DIR" >&2; exit 2 ;;
esac
