#!/usr/bin/env bash
# Make sure this machine has the full Fashion-MNIST (60k + 10k images) at
# /usr/share/datasets/fashion-mnist, from Debian's dataset-fashion-mnist package (31 MB): the
# experiment grids, the deployment bench and the GPU kit's dry run read it there. Installs it
# when missing (Debian/Ubuntu, as root); does nothing when it is there.
#   deploy/install-datasets.sh
# Elsewhere, put the four IDX files of Fashion-MNIST in a folder and pass data-dir=FOLDER.
set -euo pipefail
dir=/usr/share/datasets/fashion-mnist
files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
have_all() { for f in "${files[@]}"; do [ -s "$dir/$f" ] || return 1; done; }
have_all && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-datasets.sh: Fashion-MNIST is not in $dir; install the Debian package" \
       "dataset-fashion-mnist as root, or pass data-dir=FOLDER with its four IDX files" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; }
have_all || { echo "install-datasets.sh: dataset-fashion-mnist installed, but $dir is incomplete" >&2; exit 1; }
echo "install-datasets.sh: Fashion-MNIST installed in $dir"
