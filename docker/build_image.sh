#!/usr/bin/env bash
# Build the training image from the repository root's contents.
# Usage: docker/build_image.sh [TAG] [BASE_IMAGE]
#   TAG         image tag (default: megatron-dynapipe:latest)
#   BASE_IMAGE  a CUDA PyTorch image (default in docker/Dockerfile); match your driver's CUDA
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-megatron-dynapipe:latest}
ARGS=()
if [ -n "${2:-}" ]; then ARGS+=(--build-arg "BASE_IMAGE=$2"); fi
docker build -f docker/Dockerfile -t "$TAG" "${ARGS[@]}" .
echo "built $TAG; run it with docker/run.sh"
