#!/bin/sh
# What every rlsync image runs on, from the base image's apt: vLLM's CPU kernels link libnuma; torch's
# compiler, which vLLM (and SGLang's CPU path) run at start-up, needs g++ and Python's headers (a
# python:3.11 image has them, Debian's python3 does not).
set -e
apt-get update -q
pkgs="libnuma1 g++"
if ! python3 -c "import os, sysconfig; assert os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')" \
    2>/dev/null; then pkgs="$pkgs python3-dev"; fi
apt-get install -y -q --no-install-recommends $pkgs
rm -rf /var/lib/apt/lists/*
