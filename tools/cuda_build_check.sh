#!/usr/bin/env bash
# Compiles the fused CUDA kernels on a machine without a GPU, exactly as a GPU user's first run
# (or image build) does: the CUDA build of the pinned torch, nvcc and the CUDA headers from the
# package registry, `MEGATRON_FUSED_KERNELS_CUDA=1 python -m megatron.fused_kernels -v`, i.e.
# torch.utils.cpp_extension with torch's own extension flags (-D__CUDA_NO_HALF_OPERATORS__ ...).
# Compiler warnings are printed; a compile error fails the script. The environment (torch with
# its CUDA libraries, nvcc; about 3 GB on disk) is kept in $MEGATRON_CUDA_ENV (default
# ~/.cache/megatron-cuda-env), one folder per version key, so a second run only compiles.
#
#   bash tools/cuda_build_check.sh            # TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0"
#   TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0" bash tools/cuda_build_check.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CUDA_TOOLKIT=${CUDA_TOOLKIT:-13.0.3}   # the cuda-toolkit release torch $TORCH_VERSION's wheel requires
PYTHON=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0}
export MAX_JOBS=${MAX_JOBS:-2}

pyver=$("$PYTHON" -c 'import sys; print("%d%d" % sys.version_info[:2])')
ENV=${MEGATRON_CUDA_ENV:-$HOME/.cache/megatron-cuda-env}/torch${TORCH_VERSION}-cuda${CUDA_TOOLKIT}-py${pyver}
t0=$(date +%s)

if [ ! -e "$ENV/.complete" ]; then
  echo "== creating $ENV (torch $TORCH_VERSION CUDA build, cuda-toolkit $CUDA_TOOLKIT with nvcc)"
  rm -rf "$ENV"
  "$PYTHON" -m venv "$ENV"
  # --isolated: this machine's pip configuration may point at a folder of CPU-only wheels (a
  # find-links entry) that would win over the registry's CUDA build of the same version.
  pip_args=(--isolated --disable-pip-version-check --progress-bar off --timeout 180)
  [ -n "${PIP_CERT:-}" ] && pip_args+=(--cert "$PIP_CERT")
  "$ENV/bin/pip" install "${pip_args[@]}" "torch==$TORCH_VERSION" "cuda-toolkit[nvcc,cccl]==$CUDA_TOOLKIT" \
    numpy ninja
  du -sm "$ENV" | awk '{print "== environment size: " $1 " MB"}'
  touch "$ENV/.complete"
fi
t1=$(date +%s)

# A CUDA_HOME in the layout cpp_extension expects (bin/nvcc, include, lib64/libcudart.so), made of
# links into the registry's nvidia/cu13 package folder.
CU=$("$ENV/bin/python" -c 'import sysconfig, glob; print(sorted(glob.glob(sysconfig.get_paths()["purelib"] + "/nvidia/cu[0-9]*"))[-1])')
export CUDA_HOME="$ENV/cuda_home"
if [ ! -e "$CUDA_HOME/lib64/libcudart.so" ]; then
  mkdir -p "$CUDA_HOME/lib64"
  for d in bin include nvvm; do ln -sfn "$CU/$d" "$CUDA_HOME/$d"; done
  for f in "$CU"/lib/*; do ln -sfn "$f" "$CUDA_HOME/lib64/$(basename "$f")"; done
  ln -sfn "$(ls "$CU"/lib/libcudart.so.* | head -n1)" "$CUDA_HOME/lib64/libcudart.so"
fi
"$CUDA_HOME/bin/nvcc" --version | tail -n 2
echo "== nvcc offers: $("$CUDA_HOME/bin/nvcc" --list-gpu-arch | tr '\n' ' ')"

# A fresh build folder: the check is of these sources, not of a cached .so
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
echo "== compiling megatron/fused_kernels for TORCH_CUDA_ARCH_LIST=\"$TORCH_CUDA_ARCH_LIST\" (MAX_JOBS=$MAX_JOBS)"
cd "$ROOT"
status=0
PYTHONPATH="$ROOT" MEGATRON_FUSED_KERNELS_CUDA=1 MEGATRON_FUSED_KERNELS_DIR="$BUILD" \
  "$ENV/bin/python" -m megatron.fused_kernels -v || status=$?
t2=$(date +%s)
if [ "$status" -eq 0 ] && ! ls "$BUILD"/megatron_fused_cuda_*/*.so >/dev/null 2>&1; then
  echo "FAILED: the build finished but no CUDA extension (megatron_fused_cuda_*.so) was made"; status=1
fi
echo "{\"cuda_build_check\": {\"ok\": $([ $status -eq 0 ] && echo true || echo false), \"env_setup_s\": $((t1 - t0)), \"compile_s\": $((t2 - t1)), \"arch_list\": \"$TORCH_CUDA_ARCH_LIST\", \"torch\": \"$TORCH_VERSION\", \"cuda_toolkit\": \"$CUDA_TOOLKIT\"}}"
exit $status
